//! Embeds a file of sentences (one per line) with a replayd daemon and
//! prints the throughput.
//!
//! ```sh
//! cargo run --release --example embed_file -- sentences.txt
//! cargo run --release --example embed_file -- sentences.txt -e tcp://a:5555 -e tcp://b:5555 --batch 64 --concurrency 32
//! cargo run --release --example embed_file -- sentences.txt --json > embeddings.jsonl
//! ```
//!
//! Requests of `--batch` texts each go to the daemon(s) with `--concurrency`
//! of them in flight at once on one client (one socket per daemon); the
//! client spreads them over the daemons and re-sends those a daemon loses.

use clap::Parser;
use futures::StreamExt;
use replayd::protocol::client::{Call, Client, ClientOptions};
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    /// A text file, one sentence per line (empty lines are skipped).
    file: std::path::PathBuf,
    /// Daemon endpoint(s); repeat or comma-separate for several daemons.
    #[arg(short, long, default_value = "tcp://127.0.0.1:5555")]
    endpoint: Vec<String>,
    #[arg(short, long, default_value = "all-MiniLM-L6-v2")]
    model: String,
    /// Texts per request.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seconds each request may take (re-sends included).
    #[arg(long, default_value_t = 120.0)]
    timeout: f64,
    /// Print the embeddings to stdout, one JSON array per line, in input order.
    #[arg(long)]
    json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.file)?;
    let sentences: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    anyhow::ensure!(
        !sentences.is_empty(),
        "{} has no sentences",
        args.file.display()
    );
    let client = Client::connect_with(
        &args.endpoint,
        ClientOptions {
            timeout: Duration::from_secs_f64(args.timeout),
            ..ClientOptions::default()
        },
    )
    .await?;
    let started = Instant::now();
    let model = args.model.as_str();
    let mut results = futures::stream::iter(sentences.chunks(args.batch.max(1)))
        .map(|chunk| client.call(Call::texts(model, chunk.iter().copied())))
        .buffered(args.concurrency.max(1));
    let (mut texts, mut dim, mut resent) = (0usize, 0usize, 0u32);
    while let Some(out) = results.next().await {
        let out = out?;
        let m = out.matrix();
        texts += m.rows;
        dim = m.cols;
        resent += out.attempts - 1;
        if args.json {
            for row in m.iter_rows() {
                println!("{}", serde_json::to_string(row)?);
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "{texts} sentences, {dim} dimensions, in {secs:.3} s: {:.0} sentences/s ({} request(s) re-sent)",
        texts as f64 / secs,
        resent
    );
    for s in client.stats() {
        eprintln!(
            "  {}: {} requests, {} replies, peak {} in flight",
            s.endpoint, s.sent, s.replies, s.peak_in_flight
        );
    }
    Ok(())
}
