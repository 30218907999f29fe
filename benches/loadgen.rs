//! `replayd-loadgen`: a closed-loop load generator for a running replayd.
//!
//! Keeps `--concurrency` requests outstanding over `--sockets` DEALER
//! connections, for `--requests` requests or `--duration` seconds, and
//! reports throughput and latency percentiles (client-side, send → reply).
//! Every request must get exactly one reply; with `--texts FILE.jsonl` whose
//! lines carry an `embedding`, every returned embedding is also checked
//! against it (`--min-cosine`). Exit status 1 if any check fails.
//!
//! Texts come from a JSONL file with a `text` field per line (e.g.
//! tests/data/minilm_set_a.jsonl, or the realistic corpus that
//! `scripts/bench/make-corpus.py` writes); `--features N` sends random f32 rows
//! instead (MLP models). `--batch` texts go in each request.
//!
//! Every successful reply's per-hop timings (`decode_us` … `reply_us`, see
//! docs/protocol.md) are gathered too: the report gives each hop's p50, p90
//! and p99, and the daemon's own `total_us`, so a latency can be read as
//! where its time went. `--warmup S` leaves the first S seconds out of every
//! figure (the requests still run).
//!
//! Two engines send the requests (`--engine`): `async` (the default) runs
//! each request slot as a tokio task on replayd's Rust client, as a Rust
//! application would; `threads` gives each socket an OS thread and a plain
//! blocking libzmq DEALER that keeps its share of the slots in flight, as a
//! pyzmq client would. The second spends less CPU per request (on the 2-core
//! development VM 15 against 23 µs), which counts where the generator shares
//! the daemon's host; both report the same figures.
//!
//! With `--control ENDPOINT` (the daemon's control socket) it also reads the
//! daemon's stats before and after the run and reports, for this run alone,
//! each bucket's real and computed tokens and padding waste, and the total:
//!
//! ```sh
//! scripts/bench/make-corpus.py /tmp/corpus.jsonl
//! replayd-loadgen --model all-MiniLM-L6-v2 --texts /tmp/corpus.jsonl --batch 32 \
//!     --concurrency 256 --duration 20 --control ipc://$XDG_RUNTIME_DIR/replayd/control.sock
//! ```

use clap::Parser;
use replayd::daemon::control::{self, CallError, ControlRequest};
use replayd::daemon::stats::Stats;
use replayd::protocol::client::{Client, ClientOptions};
use replayd::protocol::{
    decode_reply, encode_request, Hops, InputKind, Payload, ReplyData, ReplyHeader, RequestHeader,
    Status,
};
use replayd::tensor::{DType, HostTensor};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser, Debug, Clone)]
#[command(about = "Closed-loop load generator for replayd")]
struct Args {
    #[arg(long, default_value = "tcp://127.0.0.1:5555")]
    endpoint: String,
    #[arg(long)]
    model: String,
    /// JSONL with a "text" (and optionally "embedding") per line.
    #[arg(long)]
    texts: Option<PathBuf>,
    /// Send random f32 rows of this width instead of texts.
    #[arg(long)]
    features: Option<usize>,
    /// Texts (or rows) per request.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Draw each request's size uniformly from 1..=batch instead.
    #[arg(long)]
    random_batch: bool,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 8)]
    sockets: usize,
    /// The generator's own runtime threads (0 = one per core). On a host it
    /// shares with the daemon, fewer leave the daemon more of the cores.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// libzmq I/O threads shared by all the generator's sockets (one context
    /// per process, as a ZeroMQ application has; 0 = one per 8 sockets).
    #[arg(long, default_value_t = 0)]
    io_threads: usize,
    /// Stop after this many requests...
    #[arg(long)]
    requests: Option<u64>,
    /// ...or after this many seconds (default 10 when --requests is absent).
    #[arg(long)]
    duration: Option<f64>,
    #[arg(long, default_value = "f32")]
    output_dtype: String,
    /// Fail if an embedding's cosine with the file's reference is below this.
    #[arg(long, default_value_t = 0.999)]
    min_cosine: f64,
    /// Check every MLP output against a float64 forward pass of this
    /// safetensors state_dict (Linear → ReLU → … → Linear); relative error < 1e-5.
    #[arg(long)]
    verify_mlp: Option<PathBuf>,
    /// Check that the same input run in the same bucket gives bit-identical
    /// outputs, whichever device ran it (texts, or a fixed set of MLP rows).
    /// Eager replies are not compared (their shapes differ per request).
    #[arg(long)]
    identical: bool,
    /// The daemon's control endpoint: report padding waste per bucket and
    /// overall for this run, from its stats before and after.
    #[arg(long)]
    control: Option<String>,
    /// Write the report here as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Seconds to wait for each reply.
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Leave replies to requests sent in the first this many seconds out of
    /// the figures (throughput, latency, hops).
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// The generator's libzmq I/O threads poll this many µs after each event
    /// before they sleep (as the daemon's `server.io_spin_us`; 0: they sleep
    /// at once, as any libzmq client's do).
    #[arg(long, default_value_t = 0)]
    io_spin_us: u64,
    /// How requests are sent (see [`Engine`]).
    #[arg(long, value_enum, default_value_t = Engine::Async)]
    engine: Engine,
    /// Open loop (threads engine): send this many requests per second in
    /// all, evenly paced per socket, with at most `--concurrency` in flight;
    /// a reply's latency runs from when its request was due, so a daemon
    /// that falls behind shows it. 0: closed loop (a new request as soon as
    /// one is answered).
    #[arg(long, default_value_t = 0.0)]
    rate: f64,
}

/// How the generator keeps its requests in flight.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Engine {
    /// One tokio task per request slot on replayd's Rust client
    /// (`protocol::client::Client`: failover, retries, a task and a channel
    /// per call), as a Rust application would.
    Async,
    /// One OS thread per socket, a plain blocking libzmq DEALER keeping its
    /// share of `--concurrency` in flight, as a pyzmq client would: a
    /// fraction of the async engine's CPU per request, which matters where
    /// the generator shares the daemon's host.
    Threads,
}

struct Corpus {
    texts: Vec<String>,
    embeddings: Vec<Option<Vec<f32>>>,
}

fn load_corpus(path: &PathBuf) -> Corpus {
    let mut texts = Vec::new();
    let mut embeddings = Vec::new();
    for (n, line) in std::fs::read_to_string(path)
        .expect("read --texts")
        .lines()
        .enumerate()
    {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("--texts line {}: not JSON: {e}", n + 1));
        texts.push(v["text"].as_str().expect("text field").to_string());
        embeddings.push(serde_json::from_value(v["embedding"].clone()).ok());
    }
    Corpus { texts, embeddings }
}

/// A float64 forward pass of an MLP state_dict (ReLU between layers).
struct MlpReference {
    layers: Vec<(Vec<f64>, Vec<f64>, usize, usize)>,
}

impl MlpReference {
    fn load(path: &PathBuf) -> Self {
        let bytes = std::fs::read(path).expect("read --verify-mlp");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
        let mut indices: Vec<usize> = st
            .names()
            .iter()
            .filter_map(|n| n.strip_suffix(".weight")?.parse().ok())
            .collect();
        indices.sort_unstable();
        let get = |name: String| -> (Vec<f64>, Vec<usize>) {
            let t = st.tensor(&name).expect("tensor");
            let v = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect();
            (v, t.shape().to_vec())
        };
        let layers = indices
            .iter()
            .map(|i| {
                let (w, shape) = get(format!("{i}.weight"));
                let (b, _) = get(format!("{i}.bias"));
                (w, b, shape[0], shape[1])
            })
            .collect();
        MlpReference { layers }
    }

    fn forward(&self, x: &[f32], rows: usize) -> Vec<f64> {
        let mut cur: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (li, (w, b, out, inp)) in self.layers.iter().enumerate() {
            let mut next = vec![0.0; rows * out];
            for r in 0..rows {
                for o in 0..*out {
                    let acc = b[o]
                        + (0..*inp)
                            .map(|i| cur[r * inp + i] * w[o * inp + i])
                            .sum::<f64>();
                    next[r * out + o] = if li + 1 < self.layers.len() {
                        acc.max(0.0)
                    } else {
                        acc
                    };
                }
            }
            cur = next;
        }
        cur
    }
}

/// (input, bucket) -> (first device, first output row), over every task.
type Seen = std::collections::HashMap<(u64, String), (String, Vec<f32>)>;

/// One request task's counts; the tasks' are merged at the end (one
/// shared lock taken per reply by hundreds of tasks slowed the generator).
#[derive(Default)]
struct Tally {
    max_rel_err: f64,
    bad_mlp: u64,
    devices: BTreeMap<String, u64>,
    max_device_diff: f32,
    nonidentical: u64,
    latencies_us: Vec<u64>,
    ok: u64,
    items: u64,
    errors: BTreeMap<String, u64>,
    min_cosine: f64,
    bad_cosine: u64,
    buckets: BTreeMap<String, u64>,
    /// Replies whose rows ran in more than one batch.
    split: u64,
    /// Per hop ([`Hops::NAMES`]), then the daemon's `total_us`: one value per reply.
    hops: Vec<Vec<u64>>,
    /// Replies (ok or not) to requests sent during the warm-up.
    warmup_replies: u64,
    /// Replies to no request in flight (the `threads` engine's count; the
    /// async engine's clients count their own).
    stray: u64,
}

impl Tally {
    fn merge(&mut self, o: Tally) {
        self.max_rel_err = self.max_rel_err.max(o.max_rel_err);
        self.bad_mlp += o.bad_mlp;
        for (k, v) in o.devices {
            *self.devices.entry(k).or_default() += v;
        }
        self.max_device_diff = self.max_device_diff.max(o.max_device_diff);
        self.nonidentical += o.nonidentical;
        self.latencies_us.extend(o.latencies_us);
        self.ok += o.ok;
        self.items += o.items;
        for (k, v) in o.errors {
            *self.errors.entry(k).or_default() += v;
        }
        self.min_cosine = self.min_cosine.min(o.min_cosine);
        self.bad_cosine += o.bad_cosine;
        for (k, v) in o.buckets {
            *self.buckets.entry(k).or_default() += v;
        }
        self.split += o.split;
        for (mine, theirs) in self.hops.iter_mut().zip(o.hops) {
            mine.extend(theirs);
        }
        self.warmup_replies += o.warmup_replies;
        self.stray += o.stray;
    }
}

/// The daemon's stats, over its control socket.
async fn daemon_stats(endpoint: &str) -> Result<Stats, String> {
    let request = ControlRequest::new("stats");
    control::call(endpoint, &request, Duration::from_secs(10))
        .await
        .map_err(|e| match e {
            CallError::Unreachable(e) => e,
            CallError::Refused(e) => format!("stats refused: {e}"),
        })
}

/// Per bucket of `model`: (batches, rows, seq slots, tokens, computed tokens).
fn bucket_totals(stats: &Stats, model: &str) -> BTreeMap<String, [u64; 5]> {
    stats
        .buckets
        .iter()
        .filter(|b| b.model == model)
        .map(|b| {
            let counts = [b.batches, b.rows, b.seq_slots, b.tokens, b.computed_tokens];
            (b.bucket.clone(), counts)
        })
        .collect()
}

/// What the run added to the daemon's bucket counters: padding waste per
/// bucket and overall, and eager sequences.
fn padding_report(before: &Stats, after: &Stats, model: &str) -> Value {
    let (b0, b1) = (bucket_totals(before, model), bucket_totals(after, model));
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let mut buckets = Vec::new();
    let (mut tokens, mut computed) = (0, 0);
    for (bucket, now) in &b1 {
        let was = b0.get(bucket).copied().unwrap_or_default();
        let d: Vec<u64> = now.iter().zip(was).map(|(a, b)| a - b).collect();
        if d[0] == 0 {
            continue;
        }
        tokens += d[3];
        computed += d[4];
        buckets.push(json!({
            "bucket": bucket,
            "batches": d[0],
            "seqs": d[1],
            "seqs_per_batch": ratio(d[1], d[0]),
            "seq_fill": ratio(d[1], d[2]),
            "tokens": d[3],
            "computed_tokens": d[4],
            "padding_waste": 1.0 - ratio(d[3], d[4]),
        }));
    }
    json!({
        "buckets": buckets,
        "tokens": tokens,
        "computed_tokens": computed,
        "padding_waste": if computed == 0 { 0.0 } else { 1.0 - ratio(tokens, computed) },
        "eager_sequences": after.eager.sequences.saturating_sub(before.eager.sequences),
        "batching": after.models.iter().find(|m| m.name == model).map(|m| m.batching.clone()),
    })
}

/// What the run added to the daemon's stage clocks (see
/// `replayd::daemon::stages`): each serial stage's share of one core, and
/// the mean wait between stages, over the daemon's uptime between the two
/// reads.
fn stages_report(before: &Stats, after: &Stats) -> Value {
    let wall_us = (after.uptime_s - before.uptime_s) * 1e6;
    let share = |us: u64| json!((us as f64 / wall_us.max(1.0) * 1000.0).round() / 1000.0);
    let mut busy = serde_json::Map::new();
    let (b0, b1) = (&before.stages.busy, &after.stages.busy);
    for (name, was, now) in [
        ("frontend_loop", b0.frontend_loop, b1.frontend_loop),
        ("batcher", b0.batcher, b1.batcher),
        ("ring_reader", b0.ring_reader, b1.ring_reader),
    ] {
        busy.insert(name.into(), share(now.busy_us.saturating_sub(was.busy_us)));
    }
    for (name, now) in &after.transport {
        let was = before.transport.get(name);
        let total_was = was.map_or(0, |w| w.total.busy_us);
        busy.insert(
            format!("{name}_socket_driver"),
            share(now.total.busy_us.saturating_sub(total_was)),
        );
        // A sharded socket (server.client_sockets): the sum above is its
        // drivers' CPU; the serial limit is the busiest one.
        let shards = now.shards.len();
        if shards > 1 {
            let busiest = now
                .shards
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let shard_was = was.and_then(|w| w.shards.get(i)).map_or(0, |w| w.busy_us);
                    s.busy_us.saturating_sub(shard_was)
                })
                .max()
                .unwrap_or(0);
            busy.insert(
                format!("{name}_socket_driver_busiest_of_{shards}"),
                share(busiest),
            );
        }
    }
    let mut delays = serde_json::Map::new();
    let (d0, d1) = (&before.stages.delays, &after.stages.delays);
    for (name, was, now) in [
        (
            "socket_to_frontend",
            d0.socket_to_frontend,
            d1.socket_to_frontend,
        ),
        ("spawn_to_handler", d0.spawn_to_handler, d1.spawn_to_handler),
        ("batcher_mailbox", d0.batcher_mailbox, d1.batcher_mailbox),
    ] {
        let sum = now.sum_us.saturating_sub(was.sum_us);
        let count = now.count.saturating_sub(was.count);
        delays.insert(
            name.into(),
            json!(if count == 0 {
                0.0
            } else {
                (sum as f64 / count as f64 * 10.0).round() / 10.0
            }),
        );
    }
    json!({"busy_share": busy, "mean_wait_us": delays, "window_s": wall_us / 1e6})
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

/// What every request slot shares: the arguments, the inputs and the
/// checks' references.
struct Run {
    args: Args,
    corpus: Option<Corpus>,
    mlp_reference: Option<MlpReference>,
    seen: Mutex<Seen>,
    issued: AtomicU64,
    started: Instant,
    duration: Option<Duration>,
    warmup: Duration,
    output_dtype: DType,
}

/// A request slot's random draws (xorshift, seeded per slot).
struct Draw(u64);

impl Draw {
    fn new(slot: usize) -> Draw {
        Draw(0x9E37_79B9_7F4A_7C15u64 ^ (slot as u64 + 1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One request as sent, and what its reply is checked against.
struct Req {
    header: RequestHeader,
    payload: Payload,
    /// Texts or rows in it.
    size: usize,
    /// The corpus lines of its texts.
    picked: Vec<usize>,
}

impl Run {
    /// Whether another request may start (`--requests`, `--duration`).
    fn may_issue(&self) -> bool {
        let n = self.issued.fetch_add(1, Ordering::Relaxed);
        !(self.args.requests.is_some_and(|r| n >= r)
            || self.duration.is_some_and(|d| self.started.elapsed() >= d))
    }

    fn make_request(&self, id: u64, draw: &mut Draw) -> Req {
        let args = &self.args;
        let size = if args.random_batch {
            1 + (draw.next() as usize % args.batch)
        } else {
            args.batch
        };
        match (&self.corpus, args.features) {
            (Some(c), _) => {
                let picked: Vec<usize> = (0..size)
                    .map(|_| draw.next() as usize % c.texts.len())
                    .collect();
                let mut header = RequestHeader::new(id, &args.model, InputKind::Texts);
                header.output_dtype = Some(self.output_dtype);
                let texts = picked.iter().map(|&i| c.texts[i].clone()).collect();
                Req {
                    header,
                    payload: Payload::Texts(texts),
                    size,
                    picked,
                }
            }
            (None, Some(f)) => {
                let x: Vec<f32> = (0..size * f)
                    .map(|_| (draw.next() % 2000) as f32 / 1000.0 - 1.0)
                    .collect();
                let mut header = RequestHeader::new(id, &args.model, InputKind::Tensor);
                header.dtype = Some(DType::F32);
                header.shape = Some(vec![size as u64, f as u64]);
                header.output_dtype = Some(self.output_dtype);
                Req {
                    header,
                    payload: Payload::Tensor(HostTensor::from_f32(vec![size, f], &x)),
                    size,
                    picked: vec![],
                }
            }
            (None, None) => unreachable!("checked in generate"),
        }
    }

    /// Counts one request's outcome (sent at `t0`) and checks its output.
    fn record(
        &self,
        t: &mut Tally,
        req: &Req,
        t0: Instant,
        reply: Result<(ReplyHeader, Option<HostTensor>), String>,
    ) {
        let args = &self.args;
        let us = t0.elapsed().as_micros() as u64;
        let counted = t0.duration_since(self.started) >= self.warmup;
        if !counted {
            t.warmup_replies += 1;
        }
        let (header, output) = match reply {
            Ok((h, _)) if h.status == Status::Ok && !counted => return,
            Ok((h, out)) if h.status == Status::Ok => (h, out),
            Ok((h, _)) => {
                let code = h.code.map_or("unknown".to_string(), |c| c.to_string());
                *t.errors.entry(code).or_default() += 1;
                return;
            }
            Err(e) => {
                *t.errors.entry(format!("client: {e}")).or_default() += 1;
                return;
            }
        };
        t.ok += 1;
        t.items += req.size as u64;
        t.latencies_us.push(us);
        if let Some(h) = Hops::from_header(&header) {
            for (k, v) in h.values().into_iter().enumerate() {
                t.hops[k].push(v);
            }
            t.hops[Hops::NAMES.len()].push(header.total_us);
        }
        if header.batches.is_some_and(|b| b > 1) {
            t.split += 1;
        }
        *t.buckets
            .entry(header.bucket.clone().unwrap_or_default())
            .or_default() += 1;
        let device = header.device.clone().unwrap_or_default();
        *t.devices.entry(device.clone()).or_default() += 1;
        if let (Some(reference), Some(out), Payload::Tensor(x)) =
            (&self.mlp_reference, &output, &req.payload)
        {
            let got = out.to_f32_vec().unwrap_or_default();
            let want = reference.forward(&x.to_f32_vec().unwrap(), req.size);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
            let err = got
                .iter()
                .zip(&want)
                .fold(0f64, |m, (a, b)| m.max((*a as f64 - b).abs()))
                / scale;
            t.max_rel_err = t.max_rel_err.max(err);
            if err >= 1e-5 || got.len() != want.len() {
                t.bad_mlp += 1;
            }
        }
        // Eager runs have request-specific shapes: not comparable; nor are
        // the rows of a request split over batches of different shapes (the
        // reply names only the largest).
        let comparable =
            header.bucket.as_deref() != Some("eager") && header.batches.is_none_or(|b| b == 1);
        if let (true, true, Some(out)) = (args.identical, comparable, &output) {
            let values = out.to_f32_vec().unwrap_or_default();
            let dim = out.shape.get(1).copied().unwrap_or(1).max(1);
            let bucket = header.bucket.clone().unwrap_or_default();
            let mut seen = self.seen.lock().unwrap();
            for (row, &k) in values.chunks(dim).zip(&req.picked) {
                let key = (k as u64, bucket.clone());
                match seen.get(&key) {
                    None => {
                        seen.insert(key, (device.clone(), row.to_vec()));
                    }
                    Some((_, first)) => {
                        let d = first
                            .iter()
                            .zip(row)
                            .map(|(a, b)| (a - b).abs())
                            .fold(0f32, f32::max);
                        t.max_device_diff = t.max_device_diff.max(d);
                        if d != 0.0 {
                            t.nonidentical += 1;
                        }
                    }
                }
            }
        }
        // Decoding every reply's floats only to find no reference was 6 % of
        // the generator's CPU.
        let checked = self
            .corpus
            .as_ref()
            .filter(|c| req.picked.iter().any(|&i| c.embeddings[i].is_some()));
        if let (Some(c), Some(out)) = (checked, &output) {
            let values = out.to_f32_vec().unwrap_or_default();
            let dim = out.shape.get(1).copied().unwrap_or(1).max(1);
            for (row, &i) in values.chunks(dim).zip(&req.picked) {
                if let Some(reference) = &c.embeddings[i] {
                    let cos = cosine(row, reference);
                    t.min_cosine = t.min_cosine.min(cos);
                    if cos < args.min_cosine {
                        t.bad_cosine += 1;
                    }
                }
            }
        }
    }
}

/// The `threads` engine's socket `index`: keeps `window` requests in flight
/// on one blocking DEALER until the run ends, then waits for what is still
/// out (each up to `--timeout`).
fn socket_thread(
    run: &Run,
    zmq_ctx: &zmq::Context,
    index: usize,
    sockets: usize,
    window: usize,
    mut t: Tally,
) -> Tally {
    let socket = zmq_ctx.socket(zmq::DEALER).expect("libzmq DEALER");
    socket.set_linger(0).expect("ZMQ_LINGER");
    socket.connect(&run.args.endpoint).expect("connect");
    let timeout = Duration::from_secs_f64(run.args.timeout);
    let mut draws: Vec<Draw> = (0..window).map(|k| Draw::new(index + k * 4096)).collect();
    // id → (request, sent at, its draw); ids are this socket's own.
    let mut in_flight: std::collections::HashMap<u64, (Req, Instant, usize)> =
        std::collections::HashMap::with_capacity(window);
    let mut next_id = (index as u64) << 40;
    let mut free: Vec<usize> = (0..window).rev().collect();
    let mut open = true;
    // Open loop: this socket's share of `--rate`, one request every `every`.
    let every =
        (run.args.rate > 0.0).then(|| Duration::from_secs_f64(sockets as f64 / run.args.rate));
    let mut due =
        Instant::now() + every.map_or(Duration::ZERO, |e| e.mul_f64(index as f64 / sockets as f64));
    loop {
        while open && !free.is_empty() {
            if every.is_some() && Instant::now() < due {
                break;
            }
            if !run.may_issue() {
                open = false;
                break;
            }
            let slot = free.pop().unwrap();
            next_id += 1;
            let req = run.make_request(next_id, &mut draws[slot]);
            let frames = encode_request(&req.header, &req.payload);
            let parts: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
            let t0 = match every {
                Some(e) => {
                    let t0 = due;
                    due += e;
                    t0
                }
                None => Instant::now(),
            };
            if let Err(e) = socket.send_multipart(parts, 0) {
                run.record(&mut t, &req, t0, Err(format!("send: {e}")));
                free.push(slot);
                continue;
            }
            in_flight.insert(next_id, (req, t0, slot));
        }
        if in_flight.is_empty() {
            if !open {
                break;
            }
            // Open loop, nothing out: sleep until the next request is due.
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            continue;
        }
        // Wait for a reply, at most until the oldest request times out (or,
        // open loop, the next request is due).
        let oldest = in_flight.values().map(|(_, t0, _)| *t0).min().unwrap();
        let mut left = timeout.saturating_sub(oldest.elapsed());
        if every.is_some() && open && !free.is_empty() {
            left = left.min(due.saturating_duration_since(Instant::now()));
            if left < Duration::from_millis(1) {
                // zmq_poll counts whole milliseconds: take what is there, then sleep the rest.
                if socket.poll(zmq::POLLIN, 0).expect("zmq_poll") == 0 {
                    std::thread::sleep(left);
                    continue;
                }
                left = Duration::ZERO;
            }
        }
        let ready = socket
            .poll(zmq::POLLIN, left.as_millis().max(1) as i64)
            .expect("zmq_poll");
        if ready == 0 && every.is_some() && oldest.elapsed() < timeout {
            continue; // a request is due, none timed out
        }
        if ready == 0 {
            let expired: Vec<u64> = in_flight
                .iter()
                .filter(|(_, (_, t0, _))| t0.elapsed() >= timeout)
                .map(|(&id, _)| id)
                .collect();
            for id in expired {
                let (req, t0, slot) = in_flight.remove(&id).unwrap();
                run.record(&mut t, &req, t0, Err("timed out".into()));
                free.push(slot);
            }
            continue;
        }
        while let Ok(frames) = socket.recv_multipart(zmq::DONTWAIT) {
            let frames: Vec<bytes::Bytes> = frames.into_iter().map(bytes::Bytes::from).collect();
            let (_, rest) = replayd::protocol::split_delimiter(&frames);
            let reply = decode_reply(rest).map(|(h, d)| (h, d.and_then(ReplyData::dense)));
            let id = match &reply {
                Ok((h, _)) => h.id,
                Err(_) => u64::MAX,
            };
            match in_flight.remove(&id) {
                Some((req, t0, slot)) => {
                    run.record(&mut t, &req, t0, reply);
                    free.push(slot);
                }
                None => t.stray += 1,
            }
        }
    }
    t
}

/// The same allocator as the daemon's (src/main.rs): the generator
/// allocates per request on every thread too.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    let args = Args::parse();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if args.threads > 0 {
        runtime.worker_threads(args.threads);
    }
    let runtime = runtime.enable_all().build().expect("tokio runtime");
    runtime.block_on(generate(args));
}

async fn generate(args: Args) {
    replayd::transport::set_io_spin(Duration::from_micros(args.io_spin_us));
    let corpus = args.texts.as_ref().map(load_corpus);
    let mlp_reference = args.verify_mlp.as_ref().map(MlpReference::load);
    if corpus.is_none() && args.features.is_none() {
        eprintln!("replayd-loadgen: give --texts FILE or --features N");
        std::process::exit(2);
    }
    if args.rate > 0.0 && args.engine != Engine::Threads {
        eprintln!("replayd-loadgen: --rate needs --engine threads");
        std::process::exit(2);
    }
    let output_dtype: DType = args.output_dtype.parse().expect("--output-dtype");
    let io_threads = match args.io_threads {
        0 => args.sockets.div_ceil(8).max(1),
        n => n,
    };
    let mut clients = Vec::new();
    if args.engine == Engine::Async {
        let mut options = ClientOptions::default();
        options.limits.shared_context = true;
        options.limits.io_threads = io_threads;
        for _ in 0..args.sockets.max(1) {
            clients.push(Arc::new(
                Client::connect_with(&[&args.endpoint], options.clone())
                    .await
                    .expect("connect"),
            ));
        }
    }
    let duration = args
        .duration
        .or(if args.requests.is_none() {
            Some(10.0)
        } else {
            None
        })
        .map(Duration::from_secs_f64);
    let stats_before = match &args.control {
        Some(endpoint) => Some(daemon_stats(endpoint).await.unwrap_or_else(|e| {
            eprintln!("replayd-loadgen: --control: {e}");
            std::process::exit(2)
        })),
        None => None,
    };
    let started = Instant::now();
    let new_tally = || Tally {
        min_cosine: 1.0,
        hops: vec![Vec::new(); Hops::NAMES.len() + 1],
        ..Default::default()
    };
    let warmup = Duration::from_secs_f64(args.warmup.max(0.0));
    let ctx = Run {
        args: args.clone(),
        corpus,
        mlp_reference,
        seen: Mutex::new(Seen::new()),
        issued: AtomicU64::new(0),
        started,
        duration,
        warmup,
        output_dtype,
    };
    let ctx = Arc::new(ctx);
    let mut t = new_tally();
    match args.engine {
        Engine::Async => {
            let mut workers = Vec::new();
            for w in 0..args.concurrency {
                let client = clients[w % clients.len()].clone();
                let ctx = ctx.clone();
                let mut t = new_tally();
                workers.push(tokio::spawn(async move {
                    let mut draw = Draw::new(w);
                    while ctx.may_issue() {
                        let id = client.next_id();
                        let req = ctx.make_request(id, &mut draw);
                        let t0 = Instant::now();
                        let reply = client
                            .request(
                                &req.header,
                                &req.payload,
                                Duration::from_secs_f64(ctx.args.timeout),
                            )
                            .await
                            .map(|r| (r.header, r.output))
                            .map_err(|e| e.to_string());
                        ctx.record(&mut t, &req, t0, reply);
                    }
                    t
                }));
            }
            for w in workers {
                t.merge(w.await.unwrap());
            }
        }
        Engine::Threads => {
            let zmq_ctx = zmq::Context::new();
            zmq_ctx
                .set_io_threads(io_threads as i32)
                .expect("libzmq io threads");
            // No more sockets than requests in flight: each keeps at least one.
            let sockets = args.sockets.clamp(1, args.concurrency.max(1));
            let mut threads = Vec::new();
            for s in 0..sockets {
                // This socket's share of the requests in flight.
                let window =
                    args.concurrency / sockets + usize::from(s < args.concurrency % sockets);
                let (ctx, zmq_ctx) = (ctx.clone(), zmq_ctx.clone());
                let tally = new_tally();
                threads.push(
                    std::thread::Builder::new()
                        .name(format!("loadgen-socket-{s}"))
                        .spawn(move || {
                            socket_thread(&ctx, &zmq_ctx, s, sockets, window.max(1), tally)
                        })
                        .expect("spawn a socket thread"),
                );
            }
            let tallies = tokio::task::spawn_blocking(move || {
                threads
                    .into_iter()
                    .map(|th| th.join().expect("a socket thread panicked"))
                    .collect::<Vec<Tally>>()
            })
            .await
            .unwrap();
            for tally in tallies {
                t.merge(tally);
            }
        }
    }
    let elapsed = (started.elapsed().as_secs_f64() - warmup.as_secs_f64()).max(1e-9);
    // Let any duplicate reply arrive before counting strays.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stray: u64 = t.stray + clients.iter().map(|c| c.stray_replies()).sum::<u64>();
    let (padding, stages) = match (&args.control, &stats_before) {
        (Some(endpoint), Some(before)) => match daemon_stats(endpoint).await {
            Ok(after) => (
                padding_report(before, &after, &args.model),
                stages_report(before, &after),
            ),
            Err(e) => (json!({"error": e}), Value::Null),
        },
        _ => (Value::Null, Value::Null),
    };
    t.latencies_us.sort_unstable();
    let mut hop_report = serde_json::Map::new();
    let hop_names: Vec<&str> = Hops::NAMES
        .iter()
        .copied()
        .chain(["daemon_total"])
        .collect();
    for (name, values) in hop_names.iter().zip(t.hops.iter_mut()) {
        values.sort_unstable();
        let q = |p: f64| {
            if values.is_empty() {
                0
            } else {
                values[((values.len() - 1) as f64 * p).round() as usize]
            }
        };
        let mean = values.iter().sum::<u64>() as f64 / values.len().max(1) as f64;
        hop_report.insert(
            name.to_string(),
            json!({"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": mean}),
        );
    }
    let pct = |q: f64| -> u64 {
        if t.latencies_us.is_empty() {
            0
        } else {
            t.latencies_us[((t.latencies_us.len() - 1) as f64 * q).round() as usize]
        }
    };
    let errors: u64 = t.errors.values().sum();
    let report = json!({
        "model": args.model,
        "concurrency": args.concurrency,
        "rate": args.rate,
        "batch": args.batch,
        "requests": t.ok + errors,
        "ok": t.ok,
        "errors": t.errors,
        "elapsed_s": elapsed,
        "requests_per_s": t.ok as f64 / elapsed,
        "items_per_s": t.items as f64 / elapsed,
        "texts_per_s": if ctx.corpus.is_some() { json!(t.items as f64 / elapsed) } else { Value::Null },
        "split_replies": t.split,
        "latency_us": {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0)},
        "sockets": args.sockets.max(1),
        "engine": format!("{:?}", args.engine).to_lowercase(),
        "warmup_s": args.warmup,
        "warmup_replies": t.warmup_replies,
        // Per hop of the daemon's replies, µs (docs/protocol.md); daemon_total is its total_us.
        "hops_us": hop_report,
        "min_cosine": if ctx.corpus.is_some() { json!(t.min_cosine) } else { Value::Null },
        "below_min_cosine": t.bad_cosine,
        "stray_replies": stray,
        "mlp_max_rel_err": if ctx.mlp_reference.is_some() { json!(t.max_rel_err) } else { Value::Null },
        "mlp_above_1e-5": t.bad_mlp,
        "devices": t.devices,
        "identical_check": if args.identical { json!({"max_abs_diff": t.max_device_diff, "differing_rows": t.nonidentical}) } else { Value::Null },
        "buckets": t.buckets,
        "padding": padding,
        "stages": stages,
    });
    println!("{report}");
    eprintln!(
        "{} ok, {} errors in {elapsed:.1} s: {:.0} {}/s; latency p50 {} µs, p99 {} µs, max {} µs",
        t.ok,
        errors,
        t.items as f64 / elapsed,
        if ctx.corpus.is_some() {
            "texts"
        } else {
            "rows"
        },
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    if !t.hops[0].is_empty() {
        let line: Vec<String> = hop_names
            .iter()
            .map(|n| format!("{n} {}", hop_report[*n]["p50"]))
            .collect();
        eprintln!("  hops p50 µs: {}", line.join(", "));
    }
    if let Some(buckets) = padding["buckets"].as_array() {
        for b in buckets {
            eprintln!(
                "  {:>8}: {:>7} batches, {:>6.1} seqs/batch, {:>10} tokens of {:>10} computed, padding waste {:>5.1}%",
                b["bucket"].as_str().unwrap_or("?"),
                b["batches"],
                b["seqs_per_batch"].as_f64().unwrap_or(0.0),
                b["tokens"],
                b["computed_tokens"],
                100.0 * b["padding_waste"].as_f64().unwrap_or(0.0)
            );
        }
        eprintln!(
            "  overall ({} batching): padding waste {:.1}%, {} sequences eager",
            padding["batching"].as_str().unwrap_or("?"),
            100.0 * padding["padding_waste"].as_f64().unwrap_or(0.0),
            padding["eager_sequences"]
        );
    }
    if let Some(busy) = stages["busy_share"].as_object() {
        let line: Vec<String> = busy.iter().map(|(k, v)| format!("{k} {v}")).collect();
        eprintln!("  serial stages, share of one core: {}", line.join(", "));
        let waits: Vec<String> = stages["mean_wait_us"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        eprintln!("  mean waits between stages, µs: {}", waits.join(", "));
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report).unwrap()).expect("write --json");
    }
    if errors > 0 || t.bad_cosine > 0 || stray > 0 || t.bad_mlp > 0 || t.nonidentical > 0 {
        std::process::exit(1);
    }
}
