//! Shape buckets: the fixed shapes graphs are captured for.
//!
//! A model is served either **padded** — a grid of (batch, seq) rectangles;
//! a batch of rows is padded to the smallest rectangle that holds it — or
//! **packed**: a ladder of token budgets; a batch's sequences are laid end
//! to end in the smallest budget that holds their tokens, up to a number of
//! sequences per graph, and only the tail of the budget is padding. MLPs
//! (no sequence axis) are always padded with `seq = 1`.

use serde::{Deserialize, Serialize};

/// One captured shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Bucket {
    /// `batch` rows of `seq` tokens (`seq = 1` without a sequence axis).
    Padded { batch: usize, seq: usize },
    /// Up to `seqs` sequences laid end to end in `tokens` token slots.
    Packed { tokens: usize, seqs: usize },
}

impl Bucket {
    /// A padded (batch, seq) bucket.
    pub fn new(batch: usize, seq: usize) -> Self {
        Bucket::Padded { batch, seq }
    }

    /// A packed token-budget bucket.
    pub fn packed(tokens: usize, seqs: usize) -> Self {
        Bucket::Packed { tokens, seqs }
    }

    /// Token slots the graph computes: `batch · seq`, or the budget.
    pub fn tokens(self) -> usize {
        match self {
            Bucket::Padded { batch, seq } => batch * seq,
            Bucket::Packed { tokens, .. } => tokens,
        }
    }

    /// Output rows the graph holds: `batch`, or the most sequences.
    pub fn rows(self) -> usize {
        match self {
            Bucket::Padded { batch, .. } => batch,
            Bucket::Packed { seqs, .. } => seqs,
        }
    }

    pub fn is_packed(self) -> bool {
        matches!(self, Bucket::Packed { .. })
    }
}

/// `"8x16"` for padded buckets, `"512t"` for packed ones (the reply's
/// `bucket` field and the stats use it).
impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bucket::Padded { batch, seq } => write!(f, "{batch}x{seq}"),
            Bucket::Packed { tokens, .. } => write!(f, "{tokens}t"),
        }
    }
}

/// A padded model's bucket grid: every batch size crossed with every seq length.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketGrid {
    batches: Vec<usize>,
    seqs: Vec<usize>,
}

impl BucketGrid {
    /// `batches` and `seqs` must be non-empty and strictly increasing (the
    /// config validator guarantees it). Pass `[1]` as `seqs` for models
    /// without a sequence axis.
    pub fn new(batches: Vec<usize>, seqs: Vec<usize>) -> Self {
        assert!(!batches.is_empty() && !seqs.is_empty(), "empty bucket grid");
        Self { batches, seqs }
    }

    pub fn batches(&self) -> &[usize] {
        &self.batches
    }

    pub fn seqs(&self) -> &[usize] {
        &self.seqs
    }

    pub fn max_batch(&self) -> usize {
        *self.batches.last().unwrap()
    }

    pub fn max_seq(&self) -> usize {
        *self.seqs.last().unwrap()
    }

    /// Smallest batch bucket holding `rows` rows.
    pub fn batch_bucket(&self, rows: usize) -> Option<usize> {
        self.batches.iter().copied().find(|&b| b >= rows)
    }

    /// Smallest seq bucket holding `len` tokens.
    pub fn seq_bucket(&self, len: usize) -> Option<usize> {
        self.seqs.iter().copied().find(|&s| s >= len)
    }

    /// Smallest bucket holding `rows` rows of at most `len` tokens.
    pub fn bucket_for(&self, rows: usize, len: usize) -> Option<Bucket> {
        Some(Bucket::new(self.batch_bucket(rows)?, self.seq_bucket(len)?))
    }

    /// Every bucket, largest (batch · seq) first: the capture order, so the
    /// first capture sizes any shared memory pool.
    pub fn largest_first(&self) -> Vec<Bucket> {
        let mut all: Vec<Bucket> = self
            .batches
            .iter()
            .flat_map(|&b| self.seqs.iter().map(move |&s| Bucket::new(b, s)))
            .collect();
        all.sort_by(|a, b| b.tokens().cmp(&a.tokens()).then(b.cmp(a)));
        all
    }
}

/// A packed model's ladder of token budgets.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenGrid {
    budgets: Vec<usize>,
    max_seqs: usize,
}

impl TokenGrid {
    /// `budgets` non-empty and strictly increasing; `max_seqs` ≥ 1 (the
    /// config validator guarantees both).
    pub fn new(budgets: Vec<usize>, max_seqs: usize) -> Self {
        assert!(!budgets.is_empty() && max_seqs > 0, "empty token grid");
        Self { budgets, max_seqs }
    }

    pub fn budgets(&self) -> &[usize] {
        &self.budgets
    }

    /// The largest budget.
    pub fn max_tokens(&self) -> usize {
        *self.budgets.last().unwrap()
    }

    /// Most sequences in a graph of `tokens` slots: never more sequences
    /// than tokens, never more than the configured cap.
    pub fn seqs_for(&self, tokens: usize) -> usize {
        tokens.min(self.max_seqs)
    }

    /// The configured sequence cap (`max_seqs_per_batch`).
    pub fn max_seqs_cap(&self) -> usize {
        self.max_seqs
    }

    /// Most sequences in any one batch.
    pub fn max_seqs(&self) -> usize {
        self.seqs_for(self.max_tokens())
    }

    /// The smallest bucket holding `seqs` sequences of `tokens` tokens in all.
    pub fn bucket_for(&self, tokens: usize, seqs: usize) -> Option<Bucket> {
        self.budgets
            .iter()
            .copied()
            .find(|&b| b >= tokens && self.seqs_for(b) >= seqs)
            .map(|b| Bucket::packed(b, self.seqs_for(b)))
    }

    /// Every bucket, largest first (the capture order).
    pub fn largest_first(&self) -> Vec<Bucket> {
        self.budgets
            .iter()
            .rev()
            .map(|&b| Bucket::packed(b, self.seqs_for(b)))
            .collect()
    }
}

/// A model's captured shapes: padded rectangles or packed token budgets.
/// (Serialised for the worker link: a reload sends a model's new grid.)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Grid {
    Padded(BucketGrid),
    Packed(TokenGrid),
}

impl Grid {
    /// Every bucket, largest first (the capture order).
    pub fn largest_first(&self) -> Vec<Bucket> {
        match self {
            Grid::Padded(g) => g.largest_first(),
            Grid::Packed(g) => g.largest_first(),
        }
    }

    /// Whether `bucket` is one of this grid's shapes.
    pub fn contains(&self, bucket: Bucket) -> bool {
        match (self, bucket) {
            (Grid::Padded(g), Bucket::Padded { batch, seq }) => {
                g.batches.contains(&batch) && g.seqs.contains(&seq)
            }
            (Grid::Packed(g), Bucket::Packed { tokens, seqs }) => {
                g.budgets.contains(&tokens) && g.seqs_for(tokens) == seqs
            }
            _ => false,
        }
    }

    /// The grid without `dropped` (buckets a device's memory does not
    /// hold): a packed grid loses those budgets, a padded one the batch
    /// sizes of those buckets. `None` when nothing would be left.
    pub fn without(&self, dropped: &[Bucket]) -> Option<Grid> {
        match self {
            Grid::Packed(g) => {
                let budgets: Vec<usize> = g
                    .budgets
                    .iter()
                    .copied()
                    .filter(|&t| !dropped.iter().any(|b| b.is_packed() && b.tokens() == t))
                    .collect();
                (!budgets.is_empty()).then(|| Grid::Packed(TokenGrid::new(budgets, g.max_seqs)))
            }
            Grid::Padded(g) => {
                let batches: Vec<usize> = g
                    .batches
                    .iter()
                    .copied()
                    .filter(|&n| {
                        !dropped
                            .iter()
                            .any(|b| matches!(*b, Bucket::Padded { batch, .. } if batch == n))
                    })
                    .collect();
                (!batches.is_empty())
                    .then(|| Grid::Padded(BucketGrid::new(batches, g.seqs.clone())))
            }
        }
    }

    /// The grid as the stats and the reload answer show it.
    pub fn describe(&self) -> GridSpec {
        match self {
            Grid::Padded(g) => GridSpec::Padded {
                batch_buckets: g.batches().to_vec(),
                seq_buckets: g.seqs().to_vec(),
            },
            Grid::Packed(g) => GridSpec::Packed {
                token_budgets: g.budgets().to_vec(),
                max_seqs_per_batch: g.max_seqs_cap(),
            },
        }
    }

    /// `"padded"` or `"packed"`.
    pub fn batching(&self) -> &'static str {
        match self {
            Grid::Padded(_) => "padded",
            Grid::Packed(_) => "packed",
        }
    }
}

/// A grid's sizes as the stats show them: `batch_buckets` and
/// `seq_buckets`, or `token_budgets` and `max_seqs_per_batch` (the config
/// keys that set them). Displayed as that JSON object (the start-up log).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum GridSpec {
    Padded {
        batch_buckets: Vec<usize>,
        seq_buckets: Vec<usize>,
    },
    Packed {
        token_budgets: Vec<usize>,
        max_seqs_per_batch: usize,
    },
}

impl Default for GridSpec {
    fn default() -> Self {
        GridSpec::Padded {
            batch_buckets: Vec::new(),
            seq_buckets: Vec::new(),
        }
    }
}

impl std::fmt::Display for GridSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| std::fmt::Error)?)
    }
}

/// Whether a batch of sequences of these lengths (token counts; one per row
/// of a model without a sequence axis) fits `bucket`: padded, at most
/// `batch` rows none longer than `seq`; packed, at most `seqs` sequences
/// whose tokens (an empty one counts 1) fit the budget.
pub fn fits(bucket: Bucket, lens: impl IntoIterator<Item = usize>) -> bool {
    let (mut rows, mut tokens, mut longest) = (0usize, 0usize, 0usize);
    for len in lens {
        rows += 1;
        tokens += len.max(1);
        longest = longest.max(len);
    }
    match bucket {
        Bucket::Padded { batch, seq } => rows <= batch && longest <= seq,
        Bucket::Packed {
            tokens: budget,
            seqs,
        } => rows <= seqs && tokens <= budget,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_grid_without_dropped_buckets() {
        use super::*;
        let packed = Grid::Packed(TokenGrid::new(vec![1024, 4096, 16384], 64));
        let cut = packed.without(&[packed.largest_first()[0]]).unwrap();
        assert_eq!(
            cut.describe(),
            GridSpec::Packed {
                token_budgets: vec![1024, 4096],
                max_seqs_per_batch: 64
            }
        );
        assert!(packed.without(&packed.largest_first()).is_none());
        let padded = Grid::Padded(BucketGrid::new(vec![1, 8, 32], vec![128, 512]));
        let cut = padded.without(&[Bucket::new(32, 512)]).unwrap();
        assert_eq!(
            cut.describe(),
            GridSpec::Padded {
                batch_buckets: vec![1, 8],
                seq_buckets: vec![128, 512]
            }
        );
    }

    use super::*;

    #[test]
    fn picks_smallest_holding_bucket() {
        let g = BucketGrid::new(vec![1, 2, 4, 8], vec![16, 32, 64]);
        assert_eq!(g.bucket_for(3, 17), Some(Bucket::new(4, 32)));
        assert_eq!(g.bucket_for(1, 16), Some(Bucket::new(1, 16)));
        assert_eq!(g.bucket_for(9, 16), None);
        assert_eq!(g.bucket_for(8, 65), None);
        let order = g.largest_first();
        assert_eq!(order.len(), 12);
        assert_eq!(order[0], Bucket::new(8, 64));
        assert_eq!(*order.last().unwrap(), Bucket::new(1, 16));
        assert_eq!(Bucket::new(8, 64).to_string(), "8x64");
    }

    #[test]
    fn token_budgets_hold_tokens_and_sequences() {
        let g = TokenGrid::new(vec![64, 256, 1024], 100);
        assert_eq!(g.bucket_for(64, 3), Some(Bucket::packed(64, 64)));
        assert_eq!(g.bucket_for(65, 3), Some(Bucket::packed(256, 100)));
        assert_eq!(g.bucket_for(10, 101), None);
        assert_eq!(g.bucket_for(1025, 1), None);
        assert_eq!(g.max_seqs(), 100);
        assert_eq!(
            g.largest_first(),
            vec![
                Bucket::packed(1024, 100),
                Bucket::packed(256, 100),
                Bucket::packed(64, 64)
            ]
        );
        let b = Bucket::packed(512, 64);
        assert_eq!(
            (b.to_string(), b.tokens(), b.rows()),
            ("512t".into(), 512, 64)
        );
    }
}
