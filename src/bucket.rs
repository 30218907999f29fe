//! Shape buckets: the fixed (batch, seq) shapes graphs are captured for.

use crate::config::ModelConfig;
use serde::{Deserialize, Serialize};

/// One captured shape. Models without a sequence axis use `seq = 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Bucket {
    pub batch: usize,
    pub seq: usize,
}

impl Bucket {
    pub fn new(batch: usize, seq: usize) -> Self {
        Self { batch, seq }
    }

    /// Elements per input row-set: `batch · seq`.
    pub fn tokens(self) -> usize {
        self.batch * self.seq
    }
}

impl std::fmt::Display for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.batch, self.seq)
    }
}

/// A model's bucket grid: every batch size crossed with every seq length.
#[derive(Clone, Debug, PartialEq, Eq)]
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

    pub fn for_model(config: &ModelConfig) -> Self {
        let seqs = match config.seq_grid() {
            [] => vec![1],
            grid => grid.to_vec(),
        };
        Self::new(config.batch_buckets.clone(), seqs)
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

#[cfg(test)]
mod tests {
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
}
