//! The shape a reply's tensor takes: its element type and, for embedding
//! models, Matryoshka truncation (a request's `dimensions`, else the
//! folder's `truncate_dim`); for sparse models, the non-zero entries of
//! each row (all, or a request's `top_k`), picked when the reply is
//! encoded ([`Sparsify`]).
//!
//! Devices always return full-width f32 rows; the batcher hands the
//! assembled rows to [`OutputForm::apply`] once per request, so a truncated
//! embedding is the full one cut, never a different graph.

use crate::model::{Matryoshka, ModelInfo, Task};
use crate::protocol::{ErrorCode, Sparsify};
use crate::tensor::{DType, HostTensor};
use bytes::Bytes;

/// How a request wants its rows back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutputForm {
    /// f32 (the default) or f16.
    pub dtype: DType,
    /// Keep the first `n` values of each row; `None`: all of them.
    pub dimensions: Option<usize>,
    /// Scale the kept values back to unit length: the model's output is
    /// L2-normalised (a `Normalize` module ends its chain), and a cut unit
    /// vector is no longer one.
    pub renormalize: bool,
    /// nomic-embed-text's recipe: the row's mean subtracted before the cut
    /// (a LayerNorm without affine, whose scale the L2 after it undoes),
    /// then L2 whatever the model does.
    pub center: bool,
    /// A sparse model: the rows go out as their non-zero entries.
    pub sparse: Option<Sparsify>,
}

impl Default for OutputForm {
    fn default() -> Self {
        OutputForm {
            dtype: DType::F32,
            dimensions: None,
            renormalize: false,
            center: false,
            sparse: None,
        }
    }
}

impl OutputForm {
    /// The form for `model`: `requested` dimensions (checked against it),
    /// else the model's `truncate_dim`. The error is `bad_request`'s message.
    pub fn for_model(
        model: &ModelInfo,
        dtype: DType,
        requested: Option<u32>,
        top_k: Option<u32>,
    ) -> Result<OutputForm, (ErrorCode, String)> {
        let width = model.output_dim;
        if model.task == Task::Sparse {
            if requested.is_some() {
                return Err((
                    ErrorCode::BadRequest,
                    format!(
                        "`dimensions` applies to dense embeddings; model {} is a sparse encoder (ask for `top_k` to keep each row's largest entries)",
                        model.name
                    ),
                ));
            }
            if top_k == Some(0) {
                return Err((
                    ErrorCode::BadRequest,
                    "`top_k` = 0 keeps nothing: ask for 1 or more (or leave it out for every non-zero entry)".into(),
                ));
            }
            return Ok(OutputForm {
                // Rows stay f32 until the encoder picks their entries.
                dtype: DType::F32,
                sparse: Some(Sparsify { top_k, dtype }),
                ..OutputForm::default()
            });
        }
        if top_k.is_some() {
            return Err((
                ErrorCode::BadRequest,
                format!(
                    "`top_k` applies to sparse encoders; model {} returns dense rows",
                    model.name
                ),
            ));
        }
        let dimensions = match requested {
            None => model.truncate_dim.filter(|&d| d < width),
            Some(d) => {
                if model.task != Task::Embed || !model.has_seq() {
                    return Err((
                        ErrorCode::BadRequest,
                        format!(
                            "`dimensions` applies to embedding models; model {} returns {}",
                            model.name,
                            if model.has_seq() {
                                "a cross-encoder's scores"
                            } else {
                                "an MLP's outputs"
                            }
                        ),
                    ));
                }
                let d = d as usize;
                if d == 0 || d > width {
                    return Err((
                        ErrorCode::BadRequest,
                        format!(
                            "`dimensions` = {d} is out of range: model {} returns {width} dimensions (ask for 1 to {width})",
                            model.name
                        ),
                    ));
                }
                (d < width).then_some(d)
            }
        };
        let center = dimensions.is_some() && model.matryoshka == Matryoshka::LayerNormThenTruncate;
        Ok(OutputForm {
            dtype,
            dimensions,
            renormalize: dimensions.is_some() && (model.normalized || center),
            center,
            sparse: None,
        })
    }

    /// The reply tensor from full-width f32 rows `[rows, width]`.
    pub fn apply(&self, rows: usize, width: usize, data: Bytes) -> HostTensor {
        let tensor = match self.dimensions {
            Some(keep) if keep < width && rows > 0 => {
                let mut out = Vec::with_capacity(rows * keep * 4);
                for row in data.chunks_exact(width * 4) {
                    let kept = &row[..keep * 4];
                    if self.renormalize {
                        let value = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64;
                        let mean = if self.center {
                            row.chunks_exact(4).map(value).sum::<f64>() / width as f64
                        } else {
                            0.0
                        };
                        let values: Vec<f32> = kept
                            .chunks_exact(4)
                            .map(|b| (value(b) - mean) as f32)
                            .collect();
                        let norm = values
                            .iter()
                            .map(|v| (*v as f64) * (*v as f64))
                            .sum::<f64>()
                            .sqrt();
                        // As torch.nn.functional.normalize: a zero row stays zero.
                        let scale = 1.0 / norm.max(1e-12);
                        for v in values {
                            out.extend_from_slice(&((v as f64 * scale) as f32).to_le_bytes());
                        }
                    } else {
                        out.extend_from_slice(kept);
                    }
                }
                HostTensor {
                    dtype: DType::F32,
                    shape: vec![rows, keep],
                    data: Bytes::from(out),
                }
            }
            _ => HostTensor {
                dtype: DType::F32,
                shape: vec![rows, width],
                data,
            },
        };
        match self.dtype {
            DType::F32 => tensor,
            other => tensor.convert_float(other).unwrap_or(tensor),
        }
    }
}

/// The first of the little-endian f32 rows of `width` values in `data`
/// that holds a NaN or an infinity.
pub fn non_finite_row(data: &[u8], width: usize) -> Option<usize> {
    let row_bytes = width.max(1) * 4;
    data.chunks_exact(row_bytes).position(|row| {
        row.chunks_exact(4)
            // Exponent bits all ones: infinity or NaN.
            .any(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{InputSpec, ModelKind};

    fn embedder(width: usize, normalized: bool, truncate_dim: Option<usize>) -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            kind: ModelKind::Bert,
            input: InputSpec::Tokens {
                vocab_size: 10,
                max_seq_len: 8,
            },
            output_dim: width,
            dtype: DType::F32,
            tokenizer_path: None,
            task: Task::Embed,
            tokenizer: None,
            prompts: Default::default(),
            derived: Vec::new(),
            normalized,
            truncate_dim,
            matryoshka: Default::default(),
        }
    }

    fn rows(values: &[f32]) -> Bytes {
        Bytes::from(
            values
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        )
    }

    #[test]
    fn truncates_and_renormalises_a_normalised_model() {
        let form =
            OutputForm::for_model(&embedder(4, true, None), DType::F32, Some(2), None).unwrap();
        assert_eq!(form.dimensions, Some(2));
        assert!(form.renormalize);
        let t = form.apply(2, 4, rows(&[0.6, 0.0, 0.8, 0.0, 0.0, 0.0, 0.0, 1.0]));
        assert_eq!(t.shape, vec![2, 2]);
        // [0.6, 0] → [1, 0]; a zero row stays zero, never NaN.
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn a_model_that_does_not_normalise_is_only_cut() {
        let form =
            OutputForm::for_model(&embedder(3, false, None), DType::F32, Some(2), None).unwrap();
        let t = form.apply(1, 3, rows(&[3.0, 4.0, 5.0]));
        assert_eq!(t.to_f32_vec().unwrap(), vec![3.0, 4.0]);
    }

    #[test]
    fn truncate_dim_is_the_default_and_a_request_overrides_it() {
        let m = embedder(4, true, Some(2));
        assert_eq!(
            OutputForm::for_model(&m, DType::F32, None, None)
                .unwrap()
                .dimensions,
            Some(2)
        );
        let full = OutputForm::for_model(&m, DType::F32, Some(4), None).unwrap();
        assert_eq!(full.dimensions, None);
        let t = full.apply(1, 4, rows(&[0.5, 0.5, 0.5, 0.5]));
        assert_eq!(t.shape, vec![1, 4]);
    }

    #[test]
    fn out_of_range_and_wrong_kinds_are_bad_requests() {
        let m = embedder(4, true, None);
        for d in [0, 5, u32::MAX] {
            let (code, msg) = OutputForm::for_model(&m, DType::F32, Some(d), None).unwrap_err();
            assert_eq!(code, ErrorCode::BadRequest);
            assert!(msg.contains("ask for 1 to 4"), "{msg}");
        }
        let mut scorer = embedder(1, false, None);
        scorer.task = Task::Score { labels: 1 };
        let (_, msg) = OutputForm::for_model(&scorer, DType::F32, Some(1), None).unwrap_err();
        assert!(msg.contains("cross-encoder"), "{msg}");
    }

    #[test]
    fn sparse_models_take_top_k_and_refuse_dimensions() {
        let mut m = embedder(30, false, None);
        m.task = Task::Sparse;
        let form = OutputForm::for_model(&m, DType::F16, None, Some(5)).unwrap();
        assert_eq!(form.dtype, DType::F32, "rows stay f32 until encoded");
        assert_eq!(
            form.sparse,
            Some(Sparsify {
                top_k: Some(5),
                dtype: DType::F16
            })
        );
        let (code, msg) = OutputForm::for_model(&m, DType::F32, Some(8), None).unwrap_err();
        assert_eq!(code, ErrorCode::BadRequest);
        assert!(msg.contains("sparse encoder"), "{msg}");
        let (_, msg) = OutputForm::for_model(&m, DType::F32, None, Some(0)).unwrap_err();
        assert!(msg.contains("`top_k` = 0"), "{msg}");
        let dense = embedder(4, true, None);
        let (_, msg) = OutputForm::for_model(&dense, DType::F32, None, Some(3)).unwrap_err();
        assert!(msg.contains("sparse encoders"), "{msg}");
    }

    #[test]
    fn nomic_layer_norms_before_the_cut() {
        let mut m = embedder(4, true, None);
        m.matryoshka = Matryoshka::LayerNormThenTruncate;
        let form = OutputForm::for_model(&m, DType::F32, Some(2), None).unwrap();
        assert!(form.center && form.renormalize);
        // mean 0.25: [1, 0.5, -0.25, -0.25] − 0.25 = [0.75, 0.25, …] → L2.
        let t = form.apply(1, 4, rows(&[1.0, 0.5, -0.25, -0.25]));
        let (a, b) = (0.75f64, 0.25f64);
        let n = (a * a + b * b).sqrt();
        let got = t.to_f32_vec().unwrap();
        assert!((got[0] as f64 - a / n).abs() < 1e-6 && (got[1] as f64 - b / n).abs() < 1e-6);
        // The full width: no cut, nothing changed.
        let full = OutputForm::for_model(&m, DType::F32, None, None).unwrap();
        assert!(!full.center);
    }

    #[test]
    fn non_finite_rows_are_found() {
        assert_eq!(non_finite_row(&rows(&[1.0, -2.0, 0.0, f32::MAX]), 2), None);
        assert_eq!(
            non_finite_row(&rows(&[1.0, 2.0, 3.0, f32::NAN]), 2),
            Some(1)
        );
        assert_eq!(
            non_finite_row(&rows(&[f32::NEG_INFINITY, 2.0, f32::INFINITY, 1.0]), 2),
            Some(0)
        );
    }

    #[test]
    fn f16_replies_are_cut_first() {
        let form =
            OutputForm::for_model(&embedder(4, false, None), DType::F16, Some(3), None).unwrap();
        let t = form.apply(1, 4, rows(&[1.0, 2.0, 3.0, 4.0]));
        assert_eq!(t.dtype, DType::F16);
        assert_eq!(t.to_f32_vec().unwrap(), vec![1.0, 2.0, 3.0]);
    }
}
