//! The rows of one batch, and how they are written into a program's static
//! inputs: padded to a (batch, seq) rectangle ([`BatchRows::pack_tokens`]),
//! or packed end to end into a token budget ([`BatchRows::pack_packed`];
//! the layout is described in [`crate::model::program`]).
//!
//! # Token flags
//!
//! A token of [`BatchRows::Tokens`] is its id in the low 30 bits
//! ([`ID_MASK`]) and two flags the tokenizer sets, so that what travels
//! from the frontend to a worker stays one `u32` per token:
//!
//! * [`SEGMENT_BIT`] (bit 31): the token belongs to the second segment of a
//!   pair, token type 1 (`[CLS] A [SEP]` are type 0, `B [SEP]` type 1 for a
//!   BERT cross-encoder); packed into the `TokenTypeIds` input.
//! * [`UNPOOLED_BIT`] (bit 30): the token is attended to but not pooled (the
//!   `prompt_length` leading tokens of a model whose pooling has
//!   `include_prompt = false`); only a prefix of a sequence carries it, and
//!   its length is packed into the `PoolSkip` input.
//!
//! Ids sent by clients never carry them (the frontend refuses ids at or
//! above the vocabulary size, and vocabularies are below 2³⁰).

use super::program::{InputRole, Layout};
use serde::{Deserialize, Serialize};

/// Token flag: second segment of a pair (token type 1).
pub const SEGMENT_BIT: u32 = 1 << 31;
/// Token flag: excluded from pooling (a prompt token with `include_prompt = false`).
pub const UNPOOLED_BIT: u32 = 1 << 30;
/// The id bits of a token.
pub const ID_MASK: u32 = UNPOOLED_BIT - 1;

/// The id of a token (flags removed).
pub fn token_id(token: u32) -> u32 {
    token & ID_MASK
}

/// The token type of a token: 1 with [`SEGMENT_BIT`], else 0.
pub fn token_type(token: u32) -> u32 {
    token >> 31
}

/// How many leading tokens of a sequence carry [`UNPOOLED_BIT`].
pub fn unpooled_prefix(tokens: &[u32]) -> usize {
    tokens
        .iter()
        .take_while(|&&t| t & UNPOOLED_BIT != 0)
        .count()
}

/// The real rows of a batch, in order, before padding to a bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum BatchRows {
    /// f32 feature rows, row-major `[rows, features]`.
    Features { features: usize, data: Vec<f32> },
    /// One token-id sequence per row (`[CLS]` … `[SEP]` included).
    Tokens(Vec<Vec<u32>>),
}

impl BatchRows {
    pub fn rows(&self) -> usize {
        match self {
            BatchRows::Features { features, data } => {
                if *features == 0 {
                    0
                } else {
                    data.len() / features
                }
            }
            BatchRows::Tokens(seqs) => seqs.len(),
        }
    }

    /// Longest sequence (1 for feature rows).
    pub fn max_len(&self) -> usize {
        match self {
            BatchRows::Features { .. } => 1,
            BatchRows::Tokens(seqs) => seqs.iter().map(Vec::len).max().unwrap_or(0),
        }
    }

    /// Real tokens over all rows (rows, for feature rows).
    pub fn tokens(&self) -> usize {
        match self {
            BatchRows::Features { .. } => self.rows(),
            BatchRows::Tokens(seqs) => seqs.iter().map(Vec::len).sum(),
        }
    }

    /// Writes the f32 feature input of a `[batch, features]` program: real rows
    /// first, zeros after. `dst.len()` must be `batch · features`.
    pub fn pack_features(&self, dst: &mut [f32]) {
        match self {
            BatchRows::Features { data, .. } => {
                assert!(data.len() <= dst.len(), "batch larger than the bucket");
                dst[..data.len()].copy_from_slice(data);
                dst[data.len()..].fill(0.0);
            }
            BatchRows::Tokens(_) => panic!("token rows packed into a feature input"),
        }
    }

    /// Writes one i32 `[batch, seq]` input of a token program: ids (0 where
    /// padded), the attention mask (1 for real tokens) or token types (0,
    /// 1 for [`SEGMENT_BIT`] tokens); `dst.len()` must be `batch · seq`. Or
    /// the `[batch]` [`InputRole::PoolSkip`] input (each row's
    /// [`unpooled_prefix`], 0 for padded rows), `dst.len()` ≥ the rows.
    pub fn pack_tokens(&self, role: InputRole, seq: usize, dst: &mut [i32]) {
        let BatchRows::Tokens(seqs) = self else {
            panic!("feature rows packed into a token input")
        };
        if role == InputRole::PoolSkip {
            pack_skip(seqs, dst);
            return;
        }
        assert!(
            seqs.len() * seq <= dst.len(),
            "batch larger than the bucket"
        );
        dst.fill(0);
        for (row, ids) in seqs.iter().enumerate() {
            assert!(ids.len() <= seq, "sequence longer than the bucket");
            let out = &mut dst[row * seq..row * seq + ids.len()];
            match role {
                InputRole::TokenIds => out
                    .iter_mut()
                    .zip(ids)
                    .for_each(|(o, &id)| *o = token_id(id) as i32),
                InputRole::AttentionMask => out.fill(1),
                InputRole::TokenTypeIds => out
                    .iter_mut()
                    .zip(ids)
                    .for_each(|(o, &id)| *o = token_type(id) as i32),
                _ => unreachable!(),
            }
        }
    }

    /// Writes one i32 input of a packed program, sequences end to end:
    ///
    /// * `TokenIds`: the ids, then 0 in the tail; `TokenTypeIds`: 0, or 1
    ///   for [`SEGMENT_BIT`] tokens, 0 in the tail;
    ///   `Positions`: `0 .. len` for each sequence, then 0 (`dst.len()` is the
    ///   token budget, at least [`BatchRows::tokens`]);
    /// * `PoolSkip`: each sequence's [`unpooled_prefix`], 0 after the last
    ///   (`dst.len()` is the most sequences);
    /// * `SeqOffsets`: the cumulative lengths `[0, l0, l0 + l1, …]`, the total
    ///   repeated in every slot after the last sequence (`dst.len()` is the
    ///   most sequences + 1, more than [`BatchRows::rows`]).
    pub fn pack_packed(&self, role: InputRole, dst: &mut [i32]) {
        let BatchRows::Tokens(seqs) = self else {
            panic!("feature rows packed into a packed token input")
        };
        match role {
            InputRole::SeqOffsets => {
                assert!(
                    seqs.len() < dst.len(),
                    "more sequences than the program holds"
                );
                let mut total = 0i32;
                dst[0] = 0;
                for (slot, ids) in dst[1..].iter_mut().zip(seqs) {
                    total += ids.len() as i32;
                    *slot = total;
                }
                dst[seqs.len() + 1..].fill(total);
            }
            InputRole::PoolSkip => pack_skip(seqs, dst),
            InputRole::TokenIds | InputRole::TokenTypeIds | InputRole::Positions => {
                let total = self.tokens();
                assert!(total <= dst.len(), "batch larger than the token budget");
                dst[total..].fill(0);
                let mut at = 0;
                for ids in seqs {
                    let out = &mut dst[at..at + ids.len()];
                    match role {
                        InputRole::TokenIds => out
                            .iter_mut()
                            .zip(ids)
                            .for_each(|(o, &id)| *o = token_id(id) as i32),
                        InputRole::TokenTypeIds => out
                            .iter_mut()
                            .zip(ids)
                            .for_each(|(o, &id)| *o = token_type(id) as i32),
                        _ => out.iter_mut().enumerate().for_each(|(p, o)| *o = p as i32),
                    }
                    at += ids.len();
                }
            }
            InputRole::Features | InputRole::AttentionMask => {
                panic!("input {role:?} in a packed program")
            }
        }
    }

    /// Packs whichever input `role` names; `dst_f32`/`dst_i32` is used by type.
    pub fn pack(&self, role: InputRole, seq: usize, dst: PackTarget<'_>) {
        match (role, dst) {
            (InputRole::Features, PackTarget::F32(d)) => self.pack_features(d),
            (role, PackTarget::I32(d)) if role.is_integer() => self.pack_tokens(role, seq, d),
            (role, _) => panic!("input {role:?} packed into the wrong element type"),
        }
    }

    /// Packs input `role` of a program of `layout` (padded rows of `seq`
    /// slots, or packed).
    pub fn pack_input(&self, layout: Layout, role: InputRole, seq: usize, dst: PackTarget<'_>) {
        match (layout, dst) {
            (Layout::Padded, dst) => self.pack(role, seq, dst),
            (Layout::Packed { .. }, PackTarget::I32(d)) => self.pack_packed(role, d),
            (Layout::Packed { .. }, PackTarget::F32(_)) => {
                panic!("input {role:?} of a packed program is not f32")
            }
        }
    }
}

/// Each sequence's [`unpooled_prefix`], then zeros.
fn pack_skip(seqs: &[Vec<u32>], dst: &mut [i32]) {
    assert!(
        seqs.len() <= dst.len(),
        "more sequences than the program holds"
    );
    dst.fill(0);
    for (d, ids) in dst.iter_mut().zip(seqs) {
        *d = unpooled_prefix(ids) as i32;
    }
}

/// A destination buffer for [`BatchRows::pack`].
pub enum PackTarget<'a> {
    F32(&'a mut [f32]),
    I32(&'a mut [i32]),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_pad_with_zero_ids_and_mask() {
        let rows = BatchRows::Tokens(vec![vec![101, 7, 102], vec![101, 102]]);
        let mut ids = vec![-1; 3 * 4];
        rows.pack_tokens(InputRole::TokenIds, 4, &mut ids);
        assert_eq!(ids, vec![101, 7, 102, 0, 101, 102, 0, 0, 0, 0, 0, 0]);
        let mut mask = vec![-1; 12];
        rows.pack_tokens(InputRole::AttentionMask, 4, &mut mask);
        assert_eq!(mask, vec![1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0]);
        let mut types = vec![-1; 12];
        rows.pack_tokens(InputRole::TokenTypeIds, 4, &mut types);
        assert_eq!(types, vec![0; 12]);
        assert_eq!(rows.rows(), 2);
        assert_eq!(rows.max_len(), 3);
    }

    #[test]
    fn sequences_pack_end_to_end() {
        // 3, 1, 0 and 2 tokens in 8 slots of at most 5 sequences.
        let rows = BatchRows::Tokens(vec![vec![101, 7, 102], vec![5], vec![], vec![101, 102]]);
        let pack = |role, n| {
            let mut v = vec![-9; n];
            rows.pack_packed(role, &mut v);
            v
        };
        assert_eq!(
            pack(InputRole::TokenIds, 8),
            vec![101, 7, 102, 5, 101, 102, 0, 0]
        );
        assert_eq!(pack(InputRole::Positions, 8), vec![0, 1, 2, 0, 0, 1, 0, 0]);
        assert_eq!(pack(InputRole::TokenTypeIds, 8), vec![0; 8]);
        assert_eq!(pack(InputRole::SeqOffsets, 6), vec![0, 3, 4, 4, 6, 6]);
        // A budget filled exactly, and as many sequences as the program holds.
        assert_eq!(pack(InputRole::TokenIds, 6), vec![101, 7, 102, 5, 101, 102]);
        assert_eq!(pack(InputRole::SeqOffsets, 5), vec![0, 3, 4, 4, 6]);
        let mut v = vec![-9; 8];
        rows.pack_input(
            Layout::Packed { tokens: 8 },
            InputRole::Positions,
            3,
            PackTarget::I32(&mut v),
        );
        assert_eq!(v, pack(InputRole::Positions, 8));
    }

    #[test]
    fn flags_become_types_and_skips() {
        let u = UNPOOLED_BIT;
        let g = SEGMENT_BIT;
        let rows = BatchRows::Tokens(vec![
            vec![101 | u, 7 | u, 102],
            vec![101, 5, 102, 9 | g, 102 | g],
        ]);
        let mut ids = vec![-1; 2 * 5];
        rows.pack_tokens(InputRole::TokenIds, 5, &mut ids);
        assert_eq!(ids, vec![101, 7, 102, 0, 0, 101, 5, 102, 9, 102]);
        let mut types = vec![-1; 3 * 5];
        rows.pack_tokens(InputRole::TokenTypeIds, 5, &mut types);
        assert_eq!(&types[..10], &[0, 0, 0, 0, 0, 0, 0, 0, 1, 1]);
        assert!(types[10..].iter().all(|&t| t == 0));
        let mut skip = vec![-1; 3];
        rows.pack_tokens(InputRole::PoolSkip, 5, &mut skip);
        assert_eq!(skip, vec![2, 0, 0]);
        let pack = |role, n| {
            let mut v = vec![-9; n];
            rows.pack_packed(role, &mut v);
            v
        };
        assert_eq!(
            pack(InputRole::TokenIds, 9),
            vec![101, 7, 102, 101, 5, 102, 9, 102, 0]
        );
        assert_eq!(
            pack(InputRole::TokenTypeIds, 9),
            vec![0, 0, 0, 0, 0, 0, 1, 1, 0]
        );
        assert_eq!(pack(InputRole::PoolSkip, 4), vec![2, 0, 0, 0]);
        assert_eq!((token_id(9 | g | u), token_type(9 | g)), (9, 1));
        assert_eq!(unpooled_prefix(&[1 | u, 2, 3 | u]), 1);
    }

    #[test]
    #[should_panic(expected = "token budget")]
    fn packing_more_tokens_than_the_budget_panics() {
        let rows = BatchRows::Tokens(vec![vec![1; 5], vec![2; 4]]);
        rows.pack_packed(InputRole::TokenIds, &mut [0; 8]);
    }

    #[test]
    #[should_panic(expected = "more sequences")]
    fn packing_more_sequences_than_the_program_holds_panics() {
        let rows = BatchRows::Tokens(vec![vec![1], vec![2]]);
        rows.pack_packed(InputRole::SeqOffsets, &mut [0; 2]);
    }

    #[test]
    fn features_pad_with_zero_rows() {
        let rows = BatchRows::Features {
            features: 2,
            data: vec![1.0, 2.0, 3.0, 4.0],
        };
        let mut dst = vec![9.0; 8];
        rows.pack_features(&mut dst);
        assert_eq!(dst, vec![1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(rows.rows(), 2);
    }
}
