//! Random inputs of the check: a seeded generator, random feature rows and
//! token sequences, and the rows of a batch that are compared with the CPU.

use crate::model::{BatchRows, InputSpec, Model};

/// xorshift64* (deterministic inputs without a dependency).
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Rng {
        Rng(seed.max(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [lo, hi] (inclusive).
    pub(super) fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
    /// Uniform in [-1, 1).
    pub(super) fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Random rows for a model: `n` feature rows, or `n` token sequences of
/// random lengths in `[min(2, seq), seq]` (`[CLS]`-like first and
/// `[SEP]`-like last ids when the vocabulary has them).
pub(super) fn random_rows(model: &Model, n: usize, seq: usize, rng: &mut Rng) -> BatchRows {
    match &model.info.input {
        InputSpec::Features { features } => BatchRows::Features {
            features: *features,
            data: (0..n * features).map(|_| rng.unit()).collect(),
        },
        InputSpec::Tokens { vocab_size, .. } => BatchRows::Tokens(
            (0..n)
                .map(|_| {
                    let len = rng.range(seq.min(2), seq);
                    random_ids(*vocab_size, len, rng)
                })
                .collect(),
        ),
    }
}

/// Token sequences of the given lengths, random ids (as [`random_rows`]).
pub(super) fn random_sequences(model: &Model, lens: &[usize], rng: &mut Rng) -> BatchRows {
    let vocab = match &model.info.input {
        InputSpec::Tokens { vocab_size, .. } => *vocab_size,
        InputSpec::Features { .. } => 1,
    };
    BatchRows::Tokens(lens.iter().map(|&l| random_ids(vocab, l, rng)).collect())
}

/// A random token sequence of `len` ids (`[CLS]`/`[SEP]`-like ends when the
/// vocabulary has them).
fn random_ids(vocab: usize, len: usize, rng: &mut Rng) -> Vec<u32> {
    let vocab = vocab.max(1);
    let lo = if vocab > 2000 { 1000 } else { 0 };
    let mut ids: Vec<u32> = (0..len).map(|_| rng.range(lo, vocab - 1) as u32).collect();
    if vocab > 103 && len >= 2 {
        ids[0] = 101;
        ids[len - 1] = 102;
    }
    ids
}

/// Rows `idx` of a batch, as a batch of their own.
pub(super) fn subset(rows: &BatchRows, idx: &[usize]) -> BatchRows {
    match rows {
        BatchRows::Features { features, data } => BatchRows::Features {
            features: *features,
            data: idx
                .iter()
                .flat_map(|&i| data[i * features..(i + 1) * features].iter().copied())
                .collect(),
        },
        BatchRows::Tokens(seqs) => {
            BatchRows::Tokens(idx.iter().map(|&i| seqs[i].clone()).collect())
        }
    }
}

/// Up to `k` row indices of `n`, spread out (first and last included).
pub(super) fn spread(n: usize, k: usize) -> Vec<usize> {
    if n == 0 || k == 0 {
        return Vec::new();
    }
    if k >= n {
        return (0..n).collect();
    }
    if k == 1 {
        return vec![0];
    }
    let mut v: Vec<usize> = (0..k).map(|i| i * (n - 1) / (k - 1)).collect();
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_selection_and_subsets() {
        assert_eq!(spread(1, 4), vec![0]);
        assert_eq!(spread(8, 4), vec![0, 2, 4, 7]);
        assert_eq!(spread(3, 4), vec![0, 1, 2]);
        assert_eq!(spread(128, 2), vec![0, 127]);
        let rows = BatchRows::Features {
            features: 2,
            data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        };
        assert_eq!(
            subset(&rows, &[0, 2]),
            BatchRows::Features {
                features: 2,
                data: vec![1.0, 2.0, 5.0, 6.0]
            }
        );
        let rows = BatchRows::Tokens(vec![vec![1], vec![2, 3], vec![4]]);
        assert_eq!(subset(&rows, &[1]), BatchRows::Tokens(vec![vec![2, 3]]));
    }

    #[test]
    fn random_tokens_fit_the_bucket() {
        let mut r = Rng::new(1);
        for _ in 0..1000 {
            let v = r.range(2, 16);
            assert!((2..=16).contains(&v));
            let u = r.unit();
            assert!((-1.0..1.0).contains(&u));
        }
        // Ids within the vocabulary, with the special ends where it has them.
        for (vocab, len) in [(30522, 16), (30522, 1), (50, 8), (1, 3)] {
            let ids = random_ids(vocab, len, &mut r);
            assert_eq!(ids.len(), len);
            assert!(ids.iter().all(|&id| (id as usize) < vocab.max(1)));
            if vocab > 103 && len >= 2 {
                assert_eq!((ids[0], ids[len - 1]), (101, 102));
            }
        }
    }
}
