//! Semantic search in a few lines: embed a small corpus once, then rank it
//! for each query by cosine similarity (the embeddings of all-MiniLM-L6-v2
//! are L2-normalised, so the dot product is the cosine).
//!
//! ```sh
//! cargo run --example semantic_search -- "How do I get my money back?" "Is it safe?"
//! cargo run --example semantic_search -- --corpus faq.txt -k 3 "where is my parcel"
//! ```

use clap::Parser;
use replayd::protocol::client::Client;

#[derive(Parser)]
struct Args {
    /// Queries to rank the corpus for.
    #[arg(required = true)]
    queries: Vec<String>,
    /// A text file, one document per line (default: a small built-in FAQ).
    #[arg(long)]
    corpus: Option<std::path::PathBuf>,
    #[arg(short, long, default_value = "tcp://127.0.0.1:5555")]
    endpoint: String,
    #[arg(short, long, default_value = "all-MiniLM-L6-v2")]
    model: String,
    /// Results per query.
    #[arg(short, default_value_t = 3)]
    k: usize,
}

const FAQ: &[&str] = &[
    "Refunds are paid to the original payment method within 5 working days.",
    "You can return any item within 30 days of delivery.",
    "Parcels are tracked from the link in your confirmation e-mail.",
    "We ship to every country in the European Union.",
    "Payments are encrypted and we never store card numbers.",
    "Our support team answers on weekdays from 9 to 5.",
    "Gift cards cannot be exchanged for cash.",
    "Change your delivery address from the order page until the parcel ships.",
];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let text;
    let corpus: Vec<&str> = match &args.corpus {
        Some(path) => {
            text = std::fs::read_to_string(path)?;
            text.lines().filter(|l| !l.trim().is_empty()).collect()
        }
        None => FAQ.to_vec(),
    };
    let client = Client::connect(&args.endpoint).await?;
    let docs = client.embed_texts(&args.model, &corpus).await?;
    let queries = client.embed_texts(&args.model, &args.queries).await?;
    for (query, q) in args.queries.iter().zip(queries.iter_rows()) {
        let mut scored: Vec<(f32, &str)> = docs
            .iter_rows()
            .zip(&corpus)
            .map(|(d, text)| (d.iter().zip(q).map(|(a, b)| a * b).sum(), *text))
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        println!("{query}");
        for (score, text) in scored.iter().take(args.k) {
            println!("  {score:.3}  {text}");
        }
    }
    Ok(())
}
