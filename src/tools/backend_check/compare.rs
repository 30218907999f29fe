//! Agreement of two outputs: the acceptance thresholds by model kind and
//! dtype, and [`compare`], which scores GPU rows against reference rows as
//! a [`Check`].

use serde::Serialize;

use crate::model::ModelKind;
use crate::tensor::DType;

/// A comparison with the CPU backend.
#[derive(Clone, Debug, Serialize)]
pub struct Check {
    /// `"max_rel_err"` (MLP) or `"min_cosine"` (BERT).
    pub metric: &'static str,
    pub value: f64,
    pub threshold: f64,
    pub pass: bool,
    pub rows: usize,
    /// Largest element-wise |gpu − cpu|.
    pub max_abs_err: f64,
}

/// Acceptance thresholds by model kind and dtype.
pub(super) fn threshold(kind: ModelKind, dtype: DType, tf32: bool) -> f64 {
    match (kind, dtype) {
        (ModelKind::Mlp, DType::F32) if tf32 => 5e-3,
        (ModelKind::Mlp, DType::F32) => 1e-5,
        (ModelKind::Mlp, DType::F16) => 1e-2,
        (ModelKind::Mlp, _) => 5e-2,
        (ModelKind::Bert, DType::F32) if tf32 => 0.999,
        (ModelKind::Bert, DType::F32) => 0.9999,
        (ModelKind::Bert, DType::F16) => 0.999,
        (ModelKind::Bert, _) => 0.99,
    }
}

/// The score tolerance (relative to max(1, |score|)) that goes with a
/// BERT cosine threshold: f32 1e-4, f16 1e-2, bf16 5e-2, as
/// `examples/family_check.rs` asserts through the daemon.
fn score_tolerance(cosine_threshold: f64) -> f64 {
    if cosine_threshold >= 0.9999 {
        1e-4
    } else if cosine_threshold >= 0.999 {
        1e-2
    } else {
        5e-2
    }
}

/// Compares `gpu` with `cpu` (both `rows × dim`): MLPs by the largest error
/// relative to the largest reference value, embeddings by the least cosine
/// of a row, one score a row by its error relative to max(1, |score|).
pub fn compare(kind: ModelKind, gpu: &[f32], cpu: &[f32], dim: usize, threshold: f64) -> Check {
    let rows = cpu.len().checked_div(dim).unwrap_or(0);
    let max_abs_err = gpu
        .iter()
        .zip(cpu)
        .map(|(g, c)| {
            let d = (*g as f64 - *c as f64).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                d
            }
        })
        .fold(0.0, f64::max);
    let length_ok = gpu.len() == cpu.len();
    match kind {
        ModelKind::Mlp => {
            let scale = cpu
                .iter()
                .map(|c| (*c as f64).abs())
                .fold(0.0, f64::max)
                .max(1e-30);
            let value = if length_ok {
                max_abs_err / scale
            } else {
                f64::INFINITY
            };
            Check {
                metric: "max_rel_err",
                value,
                threshold,
                pass: value <= threshold,
                rows,
                max_abs_err,
            }
        }
        // One score a row (cross-encoders): a cosine is only the signs'
        // agreement, which rounding flips for a score near 0; the error
        // relative to max(1, |score|) is what family_check asserts too.
        ModelKind::Bert if dim == 1 => {
            let value = if length_ok {
                gpu.iter()
                    .zip(cpu)
                    .map(|(g, c)| {
                        let d = (*g as f64 - *c as f64).abs() / (*c as f64).abs().max(1.0);
                        if d.is_nan() {
                            f64::INFINITY
                        } else {
                            d
                        }
                    })
                    .fold(0.0, f64::max)
            } else {
                f64::INFINITY
            };
            let threshold = score_tolerance(threshold);
            Check {
                metric: "max_score_err",
                value,
                threshold,
                pass: value <= threshold,
                rows,
                max_abs_err,
            }
        }
        ModelKind::Bert => {
            let mut min_cos = if length_ok { 1.0f64 } else { f64::NEG_INFINITY };
            for r in 0..rows.min(gpu.len() / dim.max(1)) {
                let (g, c) = (&gpu[r * dim..(r + 1) * dim], &cpu[r * dim..(r + 1) * dim]);
                let dot: f64 = g.iter().zip(c).map(|(a, b)| *a as f64 * *b as f64).sum();
                let ng: f64 = g.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
                let nc: f64 = c.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
                let cos = if ng == 0.0 && nc == 0.0 {
                    1.0
                } else {
                    dot / (ng * nc).max(1e-30)
                };
                min_cos = min_cos.min(if cos.is_nan() { f64::NEG_INFINITY } else { cos });
            }
            Check {
                metric: "min_cosine",
                value: min_cos,
                threshold,
                pass: min_cos >= threshold,
                rows,
                max_abs_err,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons() {
        // Scores: a sign flip near zero is within bf16's tolerance; a
        // wrong score is not, whatever its sign.
        let c = compare(ModelKind::Bert, &[0.004, 3.0], &[-0.005, 3.02], 1, 0.99);
        assert!(c.pass && c.metric == "max_score_err", "{c:?}");
        let c = compare(ModelKind::Bert, &[0.004, 3.0], &[-0.005, 3.02], 1, 0.9999);
        assert!(!c.pass, "{c:?}");
        let c = compare(ModelKind::Bert, &[0.5], &[0.9], 1, 0.99);
        assert!(!c.pass && (c.value - 0.4).abs() < 1e-6, "{c:?}");
        let c = compare(ModelKind::Mlp, &[1.0, 2.0], &[1.0, 2.0], 2, 1e-5);
        assert!(c.pass && c.value == 0.0);
        let c = compare(ModelKind::Mlp, &[1.0, 2.1], &[1.0, 2.0], 2, 1e-5);
        assert!(!c.pass && (c.value - 0.05).abs() < 1e-6, "{c:?}");
        let c = compare(ModelKind::Mlp, &[f32::NAN, 2.0], &[1.0, 2.0], 2, 1e-5);
        assert!(!c.pass);
        let c = compare(
            ModelKind::Bert,
            &[1.0, 0.0, 0.0, 2.0],
            &[2.0, 0.0, 0.0, 1.0],
            2,
            0.999,
        );
        assert!(c.pass && c.rows == 2);
        let c = compare(ModelKind::Bert, &[1.0, 0.0], &[0.0, 1.0], 2, 0.999);
        assert!(!c.pass && c.value.abs() < 1e-12);
        assert!(!compare(ModelKind::Bert, &[1.0], &[1.0, 0.0], 2, 0.9).pass);
    }

    #[test]
    fn thresholds_by_kind_and_dtype() {
        assert!(threshold(ModelKind::Mlp, DType::F32, false) <= 1e-5);
        assert!(threshold(ModelKind::Bert, DType::F16, false) >= 0.999);
    }
}
