//! Packed buckets: the token budgets of a model with `batching = "packed"`,
//! largest first. Each is captured, replayed on the batch shapes of
//! [`PackedShape`] with every output row compared with the CPU backend
//! running the same packed program, then timed on random `fill` batches.

use super::compare::{compare, threshold};
use super::context::{Ctx, Subject};
use super::inputs::{random_sequences, Rng};
use super::report::{print_profile, BucketResult, PackedCase};
use super::timing;
use crate::backend::cuda::CapturedGraph;
use crate::backend::Backend;
use crate::bucket::Bucket;
use crate::model::BatchRows;

/// The batch shapes a packed graph is checked on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PackedShape {
    /// Random lengths filling the budget exactly (or up to its sequences):
    /// three in four up to 64 tokens, the rest up to the longest allowed.
    Fill,
    /// One sequence of 16 tokens (fewer if the budget is smaller).
    One,
    /// As many sequences as the graph holds, equally long.
    Many,
    /// One sequence of the longest length, and empty sequences.
    LongAndEmpty,
}

impl PackedShape {
    /// Every shape, in the order they are checked.
    const ALL: [PackedShape; 4] = [
        PackedShape::Fill,
        PackedShape::One,
        PackedShape::Many,
        PackedShape::LongAndEmpty,
    ];

    fn name(self) -> &'static str {
        match self {
            PackedShape::Fill => "fill",
            PackedShape::One => "one",
            PackedShape::Many => "many",
            PackedShape::LongAndEmpty => "long+empty",
        }
    }

    /// Sequence lengths of this shape for a budget of `tokens` slots, at most
    /// `seqs` sequences of at most `max_len` tokens.
    fn lens(self, tokens: usize, seqs: usize, max_len: usize, rng: &mut Rng) -> Vec<usize> {
        match self {
            PackedShape::Fill => {
                let mut lens = Vec::new();
                let mut left = tokens;
                while left > 0 && lens.len() < seqs {
                    let hi = if rng.range(0, 3) < 3 {
                        max_len.min(64)
                    } else {
                        max_len
                    };
                    let len = rng.range(1, hi.max(1)).min(left);
                    lens.push(len);
                    left -= len;
                }
                lens
            }
            PackedShape::One => vec![16.min(max_len)],
            PackedShape::Many => vec![(tokens / seqs).clamp(1, max_len); seqs],
            PackedShape::LongAndEmpty => {
                let mut lens = vec![max_len];
                lens.extend(std::iter::repeat_n(0, (seqs - 1).min(2)));
                if seqs >= 4 {
                    lens.insert(1, 0);
                }
                lens.truncate(seqs);
                lens
            }
        }
    }
}

/// Captures one packed bucket of `tokens` slots and at most `seqs`
/// sequences, compares its batches with the CPU backend running the same
/// packed program, and times it (see the module docs). An `Err` ends the
/// bucket with that error; `graph` holds the graph once it is captured.
pub(super) fn check(
    c: &mut Ctx<'_>,
    Subject { mc, model, gw, cw }: Subject<'_>,
    (tokens, seqs): (usize, usize),
    res: &mut BucketResult,
    graph: &mut Option<CapturedGraph>,
) -> Result<(), String> {
    let program = model
        .program_for(Bucket::packed(tokens, seqs))
        .map_err(|e| format!("program: {e}"))?;
    let facts = program
        .validate(&model.weights)
        .map_err(|e| format!("capture: {e}"))?;
    let max_len = program.seq;
    res.seq = max_len;
    let graph = graph.insert(timing::capture(c, model, gw, &program, res)?);

    // Correctness: every row of each shape against the CPU's packed program.
    let dim = model.info.output_dim;
    let th = threshold(mc.kind, mc.dtype, c.gpu.options().allow_tf32);
    for shape in PackedShape::ALL {
        let lens = shape.lens(tokens, seqs, max_len, &mut c.rng);
        let rows = random_sequences(model, &lens, &mut c.rng);
        let name = shape.name();
        facts
            .check_rows(&rows)
            .map_err(|e| format!("{name}: {e}"))?;
        let gpu = c
            .gpu
            .launch(graph, &rows)
            .and_then(|p| c.gpu.collect(p))
            .map_err(|e| format!("replay ({name}): {e}"))?;
        let cpu = c
            .cpu
            .run_eager(model, cw, &program, &rows)
            .map_err(|e| format!("CPU reference ({name}): {e}"))?;
        let check = compare(mc.kind, &gpu, &cpu, dim, th);
        let worse = res
            .check
            .as_ref()
            .is_none_or(|w| check.value < w.value || !check.pass);
        if worse {
            res.check = Some(check.clone());
        }
        res.cases.push(PackedCase {
            name,
            seqs: lens.len(),
            tokens: lens.iter().sum(),
            check,
        });
    }

    // Latency and throughput on random fills.
    let inputs: Vec<BatchRows> = (0..4)
        .map(|_| {
            let lens = PackedShape::Fill.lens(tokens, seqs, max_len, &mut c.rng);
            random_sequences(model, &lens, &mut c.rng)
        })
        .collect();
    res.latency = timing::round_trips(c, graph, &inputs)?;
    let n = c.args.iters.max(2);
    let secs = timing::pipelined(c, graph, &inputs, n)?;
    let sent = || (0..n).map(|i| &inputs[i % inputs.len()]);
    let real_tokens: usize = sent().map(BatchRows::tokens).sum();
    let real_seqs: usize = sent().map(BatchRows::rows).sum();
    if c.args.profile {
        let p = timing::profile(c, model, gw, &program, &inputs[0])?;
        let total: f64 = p.iter().map(|(_, us)| us).sum();
        let attention: f64 = p
            .iter()
            .filter(|(n, _)| n.starts_with("attention"))
            .map(|(_, us)| us)
            .sum();
        println!(
            "    profile {}: {total:.1} µs of GPU time per batch, attention {attention:.1} µs ({} tokens, {} seqs)",
            res.bucket,
            inputs[0].tokens(),
            inputs[0].rows()
        );
        print_profile(&res.label(), &p);
        res.profile = p;
    }
    res.throughput_rows_per_s = real_seqs as f64 / secs;
    res.throughput_seqs_per_s = real_seqs as f64 / secs;
    res.throughput_tokens_per_s = real_tokens as f64 / secs;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The packed check's batches fit the bucket they are made for.
    #[test]
    fn packed_shapes_fit_their_budget() {
        let mut rng = Rng::new(3);
        for (tokens, seqs, max_len) in [
            (64, 64, 64),
            (1024, 256, 256),
            (16384, 256, 256),
            (16, 4, 16),
        ] {
            for shape in PackedShape::ALL {
                for _ in 0..50 {
                    let lens = shape.lens(tokens, seqs, max_len, &mut rng);
                    let total: usize = lens.iter().sum();
                    assert!(!lens.is_empty() && lens.len() <= seqs, "{shape:?} {lens:?}");
                    assert!(total <= tokens && lens.iter().all(|&l| l <= max_len));
                    match shape {
                        // Filled exactly unless the sequences ran out first.
                        PackedShape::Fill => assert!(total == tokens || lens.len() == seqs),
                        PackedShape::Many => assert_eq!(lens.len(), seqs),
                        PackedShape::LongAndEmpty => {
                            assert_eq!(lens[0], max_len);
                            assert!(seqs < 2 || lens[1..].iter().all(|&l| l == 0));
                        }
                        PackedShape::One => assert_eq!(lens, vec![16.min(max_len)]),
                    }
                }
            }
        }
    }
}
