//! Grid tuning: observed length histograms, and the bucket ladder that
//! would have wasted the least padding on them for the same number of
//! graphs (what `replayctl buckets` suggests).
//!
//! A ladder is a strictly increasing list of sizes (seq buckets, batch
//! buckets or token budgets); a value `v` runs in the smallest size `≥ v`
//! and wastes `size − v` slots. [`best_ladder`] keeps the largest size (it
//! decides what runs eagerly and how full batches can get, which the
//! histogram cannot predict) and chooses the others by dynamic programming:
//! the optimal boundaries lie on observed values (rounded up to `align`), and
//! the cost of a run of values between two boundaries comes from prefix sums,
//! so the search is `O(k · n²)` over at most [`MAX_CANDIDATES`] candidates.
//! Pure; unit-tested below.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Boundary candidates the search considers (beyond it they are thinned to
/// evenly spaced quantiles; the waste is still computed over every value).
pub const MAX_CANDIDATES: usize = 1024;

/// A histogram of non-negative integer values, kept exactly up to a
/// granularity (`value` is recorded as the next multiple of `granularity`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Histogram {
    pub granularity: u64,
    /// value → count, values rounded up to the granularity.
    pub counts: BTreeMap<u64, u64>,
}

impl Histogram {
    pub fn new(granularity: u64) -> Self {
        Self {
            granularity: granularity.max(1),
            counts: BTreeMap::new(),
        }
    }

    pub fn record(&mut self, value: u64) {
        self.record_n(value, 1);
    }

    pub fn record_n(&mut self, value: u64, n: u64) {
        let g = self.granularity;
        *self.counts.entry(value.div_ceil(g) * g).or_default() += n;
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }

    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    /// The smallest value with at least `q` of the counts at or below it.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.total();
        let want = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (&v, &c) in &self.counts {
            seen += c;
            if seen >= want {
                return Some(v);
            }
        }
        None
    }

    pub fn mean(&self) -> f64 {
        let total = self.total();
        if total == 0 {
            return 0.0;
        }
        self.counts
            .iter()
            .map(|(&v, &c)| v as f64 * c as f64)
            .sum::<f64>()
            / total as f64
    }

    /// Up to `bins` (upper bound, count) pairs covering the histogram,
    /// merged evenly by value, for display.
    pub fn coarse(&self, bins: usize) -> Vec<(u64, u64)> {
        let (Some(&lo), Some(&hi)) = (self.counts.keys().next(), self.counts.keys().last()) else {
            return Vec::new();
        };
        if self.counts.len() <= bins.max(1) {
            return self.counts.iter().map(|(&v, &c)| (v, c)).collect();
        }
        let width = (hi - lo).div_ceil(bins.max(1) as u64).max(1);
        let mut out: Vec<(u64, u64)> = Vec::new();
        for (&v, &c) in &self.counts {
            let upper = (lo + (v - lo).div_ceil(width).max(1) * width).min(hi);
            match out.last_mut() {
                Some((u, n)) if *u == upper => *n += c,
                _ => out.push((upper, c)),
            }
        }
        out
    }
}

/// What a ladder would waste on a histogram.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LadderCost {
    /// Values at or below the largest size (they fit a graph).
    pub fitted: u64,
    /// Values above it (they run eagerly, or are cut by the batcher).
    pub above: u64,
    /// Sum of the fitted values (real slots).
    pub real: u64,
    /// Sum of `size − value` over fitted values (padding slots).
    pub padding: u64,
    /// `padding / (real + padding)`.
    pub waste: f64,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The waste of `ladder` (sorted, increasing) on `hist`.
pub fn ladder_cost(hist: &Histogram, ladder: &[u64]) -> LadderCost {
    let max = ladder.last().copied().unwrap_or(0);
    let (mut fitted, mut above, mut real, mut padding) = (0, 0, 0, 0);
    for (&v, &c) in &hist.counts {
        match ladder.iter().find(|&&b| b >= v) {
            Some(&b) => {
                fitted += c;
                real += v * c;
                padding += (b - v) * c;
            }
            None => above += c,
        }
    }
    debug_assert!(ladder.is_empty() || max >= *ladder.first().unwrap());
    LadderCost {
        fitted,
        above,
        real,
        padding,
        waste: ratio(padding, real + padding),
    }
}

/// The ladder of at most `k` sizes ending at `max` that wastes the least on
/// `hist`, each size a multiple of `align` (except `max`, kept as it is).
/// With fewer distinct values than `k`, fewer sizes suffice (and are
/// returned). Values above `max` are ignored.
pub fn best_ladder(hist: &Histogram, k: usize, max: u64, align: u64) -> Vec<u64> {
    let align = align.max(1);
    // Fitted values and their prefix sums (count, count · value).
    let values: Vec<(u64, u64)> = hist
        .counts
        .iter()
        .filter(|(&v, _)| v <= max)
        .map(|(&v, &c)| (v, c))
        .collect();
    if k <= 1 || values.is_empty() {
        return vec![max];
    }
    let mut n_pre = vec![0u64; values.len() + 1];
    let mut s_pre = vec![0u128; values.len() + 1];
    for (i, &(v, c)) in values.iter().enumerate() {
        n_pre[i + 1] = n_pre[i] + c;
        s_pre[i + 1] = s_pre[i] + v as u128 * c as u128;
    }
    // Candidate boundaries: observed values rounded up to `align`, below `max`.
    let mut cands: Vec<u64> = values
        .iter()
        .map(|&(v, _)| v.div_ceil(align) * align)
        .filter(|&b| b < max)
        .collect();
    cands.dedup();
    if cands.len() > MAX_CANDIDATES {
        let step = cands.len() as f64 / MAX_CANDIDATES as f64;
        cands = (0..MAX_CANDIDATES)
            .map(|i| cands[((i as f64 + 1.0) * step) as usize - 1])
            .collect();
        cands.dedup();
    }
    cands.push(max);
    // Index into `values` of the first value above boundary b.
    let upto = |b: u64| values.partition_point(|&(v, _)| v <= b);
    let ends: Vec<usize> = cands.iter().map(|&b| upto(b)).collect();
    // cost of values in (cands[i], cands[j]] padded to cands[j]; i = None: from 0.
    let cost = |i: Option<usize>, j: usize| -> u128 {
        let lo = i.map_or(0, |i| ends[i]);
        let hi = ends[j];
        cands[j] as u128 * (n_pre[hi] - n_pre[lo]) as u128 - (s_pre[hi] - s_pre[lo])
    };
    let m = cands.len();
    let k = k.min(m);
    // dp[t][j]: least cost covering every value ≤ cands[j] with t+1 sizes, the last cands[j].
    let mut dp = vec![vec![u128::MAX; m]; k];
    let mut from = vec![vec![usize::MAX; m]; k];
    for (j, first) in dp[0].iter_mut().enumerate() {
        *first = cost(None, j);
    }
    for t in 1..k {
        for j in t..m {
            for i in (t - 1)..j {
                if dp[t - 1][i] == u128::MAX {
                    continue;
                }
                let c = dp[t - 1][i] + cost(Some(i), j);
                if c < dp[t][j] {
                    dp[t][j] = c;
                    from[t][j] = i;
                }
            }
        }
    }
    // The best number of sizes up to k (more never hurts, but equal cost
    // with fewer graphs is preferred).
    let last = m - 1;
    let mut best_t = 0;
    for t in 0..k {
        if dp[t][last] < dp[best_t][last] {
            best_t = t;
        }
    }
    let mut ladder = vec![cands[last]];
    let (mut t, mut j) = (best_t, last);
    while t > 0 {
        j = from[t][j];
        t -= 1;
        ladder.push(cands[j]);
    }
    ladder.reverse();
    ladder
}

/// The config key of a ladder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LadderKey {
    SeqBuckets,
    BatchBuckets,
    TokenBudgets,
}

impl LadderKey {
    pub fn as_str(self) -> &'static str {
        match self {
            LadderKey::SeqBuckets => "seq_buckets",
            LadderKey::BatchBuckets => "batch_buckets",
            LadderKey::TokenBudgets => "token_budgets",
        }
    }
}

/// A suggestion for one ladder of a model's grid.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LadderSuggestion {
    /// The config key it is for.
    pub key: LadderKey,
    pub current: Vec<u64>,
    pub suggested: Vec<u64>,
    pub current_cost: LadderCost,
    pub suggested_cost: LadderCost,
}

impl LadderSuggestion {
    /// Compares `current` with the best ladder of as many sizes on `hist`.
    pub fn new(key: LadderKey, hist: &Histogram, current: &[u64], align: u64) -> Self {
        let max = current.last().copied().unwrap_or(0);
        let suggested = best_ladder(hist, current.len(), max, align);
        let current_cost = ladder_cost(hist, current);
        let mut suggested_cost = ladder_cost(hist, &suggested);
        // Never suggest something worse than what is in force.
        let suggested = if suggested_cost.padding > current_cost.padding {
            suggested_cost = current_cost.clone();
            current.to_vec()
        } else {
            suggested
        };
        LadderSuggestion {
            key,
            current: current.to_vec(),
            suggested,
            current_cost,
            suggested_cost,
        }
    }

    pub fn changes(&self) -> bool {
        self.suggested != self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hist(values: &[(u64, u64)]) -> Histogram {
        let mut h = Histogram::new(1);
        for &(v, c) in values {
            h.record_n(v, c);
        }
        h
    }

    /// Exhaustive search over every ladder of at most k sizes ending at max.
    fn brute(h: &Histogram, k: usize, max: u64) -> u64 {
        fn go(h: &Histogram, start: u64, left: usize, max: u64, acc: &mut Vec<u64>) -> u64 {
            acc.push(max);
            let mut best = ladder_cost(h, acc).padding;
            acc.pop();
            if left > 0 {
                for b in start..max {
                    acc.push(b);
                    best = best.min(go(h, b + 1, left - 1, max, acc));
                    acc.pop();
                }
            }
            best
        }
        go(h, 1, k - 1, max, &mut Vec::new())
    }

    #[test]
    fn the_dp_finds_the_least_padding_ladder() {
        let h = hist(&[(3, 10), (5, 1), (9, 7), (10, 2), (17, 30), (18, 1), (30, 4)]);
        for k in 1..=5 {
            let ladder = best_ladder(&h, k, 32, 1);
            assert!(
                ladder.len() <= k && *ladder.last().unwrap() == 32,
                "{ladder:?}"
            );
            assert!(ladder.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(
                ladder_cost(&h, &ladder).padding,
                brute(&h, k, 32),
                "k={k} {ladder:?}"
            );
        }
        // Enough sizes: every observed value gets its own (the largest, 32,
        // is kept as well), so nothing is padded.
        let ladder = best_ladder(&h, 10, 32, 1);
        assert_eq!(ladder, vec![3, 5, 9, 10, 17, 18, 30, 32]);
        assert_eq!(ladder_cost(&h, &ladder).padding, 0);
    }

    #[test]
    fn alignment_and_values_above_the_largest_size() {
        // Texts of 17..=24 tokens mostly, a few long ones beyond the grid.
        let h = hist(&[(17, 50), (20, 20), (24, 30), (100, 5), (300, 3)]);
        let s = LadderSuggestion::new(LadderKey::SeqBuckets, &h, &[16, 32, 64, 128, 256], 8);
        assert_eq!(s.current_cost.above, 3);
        assert_eq!(s.suggested.last(), Some(&256));
        assert!(s.suggested.iter().all(|b| b % 8 == 0));
        assert!(s.suggested.contains(&24), "{:?}", s.suggested);
        assert!(s.suggested_cost.padding < s.current_cost.padding);
        assert!(s.suggested_cost.waste < s.current_cost.waste);
        assert!(s.changes());
        // The current grid's waste is what it is on the same histogram.
        let cur = ladder_cost(&h, &[16, 32, 64, 128, 256]);
        assert_eq!(cur.padding, 50 * 15 + 20 * 12 + 30 * 8 + 5 * 28);
    }

    #[test]
    fn a_ladder_that_is_already_best_is_kept() {
        let h = hist(&[(8, 10), (16, 10)]);
        let s = LadderSuggestion::new(LadderKey::BatchBuckets, &h, &[8, 16], 1);
        assert!(!s.changes());
        assert_eq!(s.suggested_cost.padding, 0);
    }

    #[test]
    fn histograms_round_to_their_granularity_and_summarise() {
        let mut h = Histogram::new(16);
        for v in [1, 16, 17, 40] {
            h.record(v);
        }
        assert_eq!(h.counts, BTreeMap::from([(16, 2), (32, 1), (48, 1)]));
        assert_eq!(h.quantile(0.5), Some(16));
        assert_eq!(h.quantile(1.0), Some(48));
        assert_eq!(h.total(), 4);
        let mut fine = Histogram::new(1);
        for v in 1..=100 {
            fine.record(v);
        }
        let c = fine.coarse(10);
        assert_eq!(c.len(), 10);
        assert_eq!(c.iter().map(|p| p.1).sum::<u64>(), 100);
        assert_eq!(c.last().unwrap().0, 100);
    }

    #[test]
    fn many_distinct_values_are_thinned_but_costed_exactly() {
        let mut h = Histogram::new(1);
        for v in 1..=5000u64 {
            h.record_n(v, 1 + v % 7);
        }
        let ladder = best_ladder(&h, 9, 8192, 1);
        assert_eq!(ladder.len(), 9);
        let even: Vec<u64> = (1..=9).map(|i| i * 8192 / 9).collect();
        assert!(ladder_cost(&h, &ladder).padding < ladder_cost(&h, &even).padding);
    }
}
