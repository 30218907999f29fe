//! The CPU backend against reference data: the MLP against PyTorch's float64
//! outputs and a float64 reference computed here, MiniLM against
//! sentence-transformers' embeddings, padding invariance, bad batches and
//! fault injection; packed programs in [`packed`].

use super::*;
use crate::model::{Architecture, InputRole};
use crate::model::{ModelKind, ModelSpec};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

const THREADS: usize = 2;

/// The reference outputs (PyTorch, sentence-transformers), kept in the repo.
fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

use crate::model::minilm_dir as model_dir;

pub(crate) fn model_config(kind: ModelKind, path: &Path) -> ModelSpec {
    ModelSpec::new("test", kind, path)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// ‖got − want‖ / ‖want‖.
fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let diff: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w).powi(2))
        .sum();
    let norm: f64 = want.iter().map(|w| w * w).sum();
    (diff / norm).sqrt()
}

// ---------------------------------------------------------------- MLP

#[derive(Deserialize)]
struct MlpCase {
    input: Vec<Vec<f64>>,
    output: Vec<Vec<f64>>,
}

fn mlp_model() -> Model {
    let config = model_config(
        ModelKind::Mlp,
        &reference_dir().join("mlp_seed.safetensors"),
    );
    Model::load(&config).unwrap()
}

fn feature_rows(rows: &[Vec<f64>]) -> BatchRows {
    BatchRows::Features {
        features: rows[0].len(),
        data: rows.iter().flatten().map(|&v| v as f32).collect(),
    }
}

#[test]
fn mlp_matches_pytorch_float64_in_every_bucket() {
    let model = mlp_model();
    assert_eq!(
        model.info.input,
        crate::model::InputSpec::Features { features: 128 }
    );
    assert_eq!(model.info.output_dim, 10);
    let text = std::fs::read_to_string(reference_dir().join("mlp_seed_io.jsonl")).unwrap();
    let cases: Vec<MlpCase> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(cases.len(), 4);
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(&model).unwrap();
    for trim in [true, false] {
        backend.set_trim_padding(trim);
        let mut graphs: Vec<CpuGraph> = [1, 4, 8, 16, 64]
            .iter()
            .map(|&b| {
                backend
                    .capture(&model, &weights, &model.program(b, 1))
                    .unwrap()
            })
            .collect();
        for case in &cases {
            let rows = feature_rows(&case.input);
            let want: Vec<f64> = case.output.iter().flatten().copied().collect();
            let mut checked = 0;
            for graph in graphs.iter_mut().filter(|g| g.batch() >= case.input.len()) {
                let pending = backend.launch(graph, &rows).unwrap();
                let got = backend.collect(pending).unwrap();
                let err = relative_error(&got, &want);
                assert!(
                    err < 1e-5,
                    "batch {} in bucket {}: {err}",
                    case.input.len(),
                    graph.batch()
                );
                checked += 1;
            }
            assert!(checked >= 2);
            let program = model.program(case.input.len(), 1);
            let got = backend
                .run_eager(&model, &weights, &program, &rows)
                .unwrap();
            assert!(relative_error(&got, &want) < 1e-5);
        }
    }
}

/// A float64 forward pass of an MLP from its (f32) weights.
fn mlp_f64(model: &Model, input: &[f32], rows: usize) -> Vec<f64> {
    let Architecture::Mlp(arch) = &model.arch else {
        panic!("not an MLP")
    };
    let mut x: Vec<f64> = input.iter().map(|&v| v as f64).collect();
    for layer in &arch.layers {
        let w = model.weights.get(layer.weight).data.to_f32();
        let bias = layer.bias.map(|b| model.weights.get(b).data.to_f32());
        let (n, k) = (layer.out_features, layer.in_features);
        let mut y = vec![0.0f64; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let mut acc = bias.as_ref().map_or(0.0, |b| b[j] as f64);
                for i in 0..k {
                    acc += x[r * k + i] * w[j * k + i] as f64;
                }
                y[r * n + j] = match layer.activation {
                    crate::model::Activation::Identity => acc,
                    crate::model::Activation::Relu => acc.max(0.0),
                    crate::model::Activation::Gelu => {
                        0.5 * acc
                            * (1.0 + crate::model::program::erf_f64(acc / std::f64::consts::SQRT_2))
                    }
                    other => other.apply(acc as f32) as f64,
                };
            }
        }
        x = y;
    }
    x
}

#[test]
fn mlp_matches_float64_reference_on_random_inputs() {
    let model = mlp_model();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(&model).unwrap();
    let mut graph = backend
        .capture(&model, &weights, &model.program(32, 1))
        .unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    for rows in [1, 5, 17, 32] {
        let data: Vec<f32> = (0..rows * 128)
            .map(|_| rng.random_range(-3.0f32..3.0))
            .collect();
        let want = mlp_f64(&model, &data, rows);
        let batch = BatchRows::Features {
            features: 128,
            data,
        };
        let pending = backend.launch(&mut graph, &batch).unwrap();
        let got = backend.collect(pending).unwrap();
        assert!(relative_error(&got, &want) < 1e-5, "{rows} rows");
    }
}

/// Writes an MLP folder: `model.safetensors` (f16 weights) and `config.json`.
fn write_mlp(dir: &Path, dims: &[usize], activation: &str) {
    let mut rng = StdRng::seed_from_u64(3);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, pair) in dims.windows(2).enumerate() {
        let (k, n) = (pair[0], pair[1]);
        let to_f16 = |v: Vec<f32>| -> Vec<u8> {
            v.into_iter()
                .flat_map(|x| half::f16::from_f32(x).to_le_bytes())
                .collect()
        };
        let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.5f32..0.5)).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        tensors.push((format!("{}.weight", 2 * i), vec![n, k], to_f16(w)));
        tensors.push((format!("{}.bias", 2 * i), vec![n], to_f16(b)));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, shape.clone(), data)
                    .unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        format!(r#"{{"model_type": "mlp", "activation": "{activation}"}}"#),
    )
    .unwrap();
}

#[test]
fn mlp_folder_with_config_json_and_f16_weights() {
    let dir = tempfile::tempdir().unwrap();
    write_mlp(dir.path(), &[6, 20, 9, 3], "gelu");
    let mut config = model_config(ModelKind::Mlp, dir.path());
    let info = crate::model::inspect(&config).unwrap();
    assert_eq!(
        info.input,
        crate::model::InputSpec::Features { features: 6 }
    );
    assert_eq!(info.output_dim, 3);
    let model = Model::load(&config).unwrap();
    let Architecture::Mlp(arch) = &model.arch else {
        panic!()
    };
    assert_eq!(arch.activation, crate::model::Activation::Gelu);
    assert_eq!(arch.layers.len(), 3);
    assert_eq!(
        arch.layers[2].activation,
        crate::model::Activation::Identity
    );
    let program = model.program(4, 99);
    assert_eq!((program.batch, program.seq, program.output_dim), (4, 1, 3));
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(&model).unwrap();
    let data: Vec<f32> = (0..3 * 6).map(|i| (i as f32 * 0.37).sin()).collect();
    let want = mlp_f64(&model, &data, 3);
    let got = backend
        .run_eager(
            &model,
            &weights,
            &program,
            &BatchRows::Features {
                features: 6,
                data: data.clone(),
            },
        )
        .unwrap();
    assert!(relative_error(&got, &want) < 1e-5);

    // The config's activation overrides config.json.
    config.activation = Some("tanh".into());
    let model = Model::load(&config).unwrap();
    let Architecture::Mlp(arch) = &model.arch else {
        panic!()
    };
    assert_eq!(arch.layers[0].activation, crate::model::Activation::Tanh);
}

#[test]
fn mlp_errors_name_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.safetensors");
    // Layers that do not chain: 0 is [8, 4], 2 is [3, 5].
    let w0 = vec![0u8; 8 * 4 * 4];
    let w2 = vec![0u8; 3 * 5 * 4];
    let views = vec![
        (
            "0.weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8, 4], &w0).unwrap(),
        ),
        (
            "2.weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3, 5], &w2).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let config = model_config(ModelKind::Mlp, &path);
    for err in [
        crate::model::inspect(&config).unwrap_err(),
        Model::load(&config).unwrap_err(),
    ] {
        let msg = err.to_string();
        assert!(
            msg.contains("broken.safetensors")
                && msg.contains("`2.weight`")
                && msg.contains("`0.weight`"),
            "{msg}"
        );
    }
    // A bias of the wrong size.
    let b0 = vec![0u8; 7 * 4];
    let views = vec![
        (
            "0.weight",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![8, 4], &w0).unwrap(),
        ),
        (
            "0.bias",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![7], &b0).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let msg = Model::load(&config).unwrap_err().to_string();
    assert!(
        msg.contains("broken.safetensors") && msg.contains("`0.bias`") && msg.contains("[7]"),
        "{msg}"
    );
    // Missing file; a folder without model.safetensors; a bad config.json.
    let msg = Model::load(&model_config(
        ModelKind::Mlp,
        &dir.path().join("nope.safetensors"),
    ))
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("nope.safetensors") && msg.contains("missing"),
        "{msg}"
    );
    let sub = dir.path().join("folder");
    std::fs::create_dir(&sub).unwrap();
    let msg = crate::model::inspect(&model_config(ModelKind::Mlp, &sub))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("model.safetensors") && msg.contains("missing"),
        "{msg}"
    );
    write_mlp(&sub, &[2, 2], "relu");
    std::fs::write(sub.join("config.json"), r#"{"activation": "mish"}"#).unwrap();
    let msg = crate::model::inspect(&model_config(ModelKind::Mlp, &sub))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("config.json") && msg.contains("mish"), "{msg}");
}

/// Bad batches never reach a backend: the program's facts refuse them (the
/// worker checks every batch before a replay), and the graph works after.
#[test]
fn bad_batches_are_invalid_not_panics() {
    let model = mlp_model();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(&model).unwrap();
    let program = model.program(4, 1);
    let facts = program.validate(&model.weights).unwrap();
    let mut graph = backend.capture(&model, &weights, &program).unwrap();
    let features = |features, data| BatchRows::Features { features, data };
    let bad = [
        features(128, vec![0.0; 5 * 128]),
        features(127, vec![0.0; 127]),
        features(128, vec![0.0; 100]),
        features(128, vec![]),
        BatchRows::Tokens(vec![vec![101, 102]]),
    ];
    for rows in &bad {
        let err = facts.check_rows(rows).unwrap_err();
        assert!(!err.to_string().is_empty(), "{rows:?}");
    }
    // The graph works.
    let ok = features(128, vec![0.5; 4 * 128]);
    let pending = backend.launch(&mut graph, &ok).unwrap();
    assert_eq!(backend.collect(pending).unwrap().len(), 40);
    assert_eq!(
        backend.graph_memory_bytes(&graph),
        (4 * 128 + 4 * 256 + 4 * 10) as u64 * 4
    );
}

#[test]
fn injected_fault_poisons_launch_and_collect() {
    let model = mlp_model();
    let mut backend = CpuBackend::new(3, 1);
    assert_eq!(backend.info().backend, "cpu");
    assert_eq!(backend.info().ordinal, 3);
    let weights = backend.upload(&model).unwrap();
    let mut graph = backend
        .capture(&model, &weights, &model.program(2, 1))
        .unwrap();
    let rows = BatchRows::Features {
        features: 128,
        data: vec![1.0; 128],
    };
    let before = backend.launch(&mut graph, &rows).unwrap();
    backend.inject_fault().unwrap();
    for err in [
        backend.collect(before).unwrap_err(),
        backend.launch(&mut graph, &rows).unwrap_err(),
        backend
            .run_eager(&model, &weights, &model.program(1, 1), &rows)
            .unwrap_err(),
        backend
            .capture(&model, &weights, &model.program(1, 1))
            .err()
            .unwrap(),
    ] {
        assert!(
            matches!(err, BackendError::DeviceFault(_)) && err.is_fatal(),
            "{err:?}"
        );
    }
}

// ---------------------------------------------------------------- MiniLM

#[derive(Deserialize)]
struct MiniLmLine {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn minilm() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| Model::load(&model_config(ModelKind::Bert, &model_dir())).unwrap())
}

fn minilm_reference() -> &'static [MiniLmLine] {
    static LINES: OnceLock<Vec<MiniLmLine>> = OnceLock::new();
    LINES.get_or_init(|| {
        std::fs::read_to_string(reference_dir().join("minilm_set_a.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    })
}

const SEQ_BUCKETS: [usize; 5] = [16, 32, 64, 128, 256];

/// Embeds `seqs` through captured graphs of `batch` rows at the smallest seq
/// bucket that holds each chunk; sequences are grouped by length first.
fn embed_bucketed(
    backend: &mut CpuBackend,
    weights: &CpuWeights,
    seqs: &[&[u32]],
    batch: usize,
) -> Vec<Vec<f32>> {
    let model = minilm();
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by_key(|&i| seqs[i].len());
    let mut graphs: HashMap<usize, CpuGraph> = HashMap::new();
    let mut out = vec![Vec::new(); seqs.len()];
    for chunk in order.chunks(batch) {
        let longest = chunk.iter().map(|&i| seqs[i].len()).max().unwrap();
        let seq = *SEQ_BUCKETS.iter().find(|&&s| s >= longest).unwrap();
        let graph = graphs.entry(seq).or_insert_with(|| {
            backend
                .capture(model, weights, &model.program(batch, seq))
                .unwrap()
        });
        let rows = BatchRows::Tokens(chunk.iter().map(|&i| seqs[i].to_vec()).collect());
        let pending = backend.launch(graph, &rows).unwrap();
        let flat = backend.collect(pending).unwrap();
        assert_eq!(flat.len(), chunk.len() * 384);
        for (row, &i) in flat.chunks_exact(384).zip(chunk) {
            out[i] = row.to_vec();
        }
    }
    out
}

#[test]
fn minilm_all_300_reference_embeddings_through_graphs() {
    let model = minilm();
    let lines = minilm_reference();
    assert_eq!(lines.len(), 300);
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let seqs: Vec<&[u32]> = lines.iter().map(|l| l.ids.as_slice()).collect();
    let start = Instant::now();
    let got = embed_bucketed(&mut backend, &weights, &seqs, 32);
    let elapsed = start.elapsed();
    eprintln!(
        "minilm: 300 reference texts through (32, bucket) graphs in {:.2} s ({:.0} texts/s)",
        elapsed.as_secs_f64(),
        300.0 / elapsed.as_secs_f64()
    );
    let mut worst = (f64::INFINITY, 0usize);
    for (i, (line, emb)) in lines.iter().zip(&got).enumerate() {
        let c = cosine(emb, &line.embedding);
        if c < worst.0 {
            worst = (c, i);
        }
        assert!(c >= 0.9999, "line {i} {:?}: cosine {c}", line.text);
        let norm: f32 = emb.iter().map(|v| v * v).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "line {i}: norm {norm}");
    }
    eprintln!(
        "minilm: worst cosine 1 - {:.2e} (line {})",
        1.0 - worst.0,
        worst.1
    );
}

/// The serving path above computes real rows only; here the same graphs run
/// their whole padded (32, bucket) shape, for a mixed-length sample in file
/// order, and must agree with the reference and with the trimmed replay.
#[test]
fn minilm_reference_sample_in_fully_padded_buckets() {
    let model = minilm();
    let lines = &minilm_reference()[..64];
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    for chunk in lines.chunks(32) {
        let longest = chunk.iter().map(|l| l.ids.len()).max().unwrap();
        let seq = *SEQ_BUCKETS.iter().find(|&&s| s >= longest).unwrap();
        let mut graph = backend
            .capture(model, &weights, &model.program(32, seq))
            .unwrap();
        let rows = BatchRows::Tokens(
            chunk[..chunk.len() - 3]
                .iter()
                .map(|l| l.ids.clone())
                .collect(),
        );
        backend.set_trim_padding(false);
        let p = backend.launch(&mut graph, &rows).unwrap();
        let padded = backend.collect(p).unwrap();
        backend.set_trim_padding(true);
        let p = backend.launch(&mut graph, &rows).unwrap();
        let trimmed = backend.collect(p).unwrap();
        for (i, (emb, line)) in padded.chunks_exact(384).zip(chunk).enumerate() {
            let c = cosine(emb, &line.embedding);
            assert!(
                c >= 0.9999,
                "{i} {:?}: cosine {c} in (32, {seq})",
                line.text
            );
        }
        let max = padded
            .iter()
            .zip(&trimmed)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(max < 1e-5, "padded vs trimmed replay: {max}");
    }
}

#[test]
fn minilm_eager_long_text() {
    let model = minilm();
    let lines = minilm_reference();
    let longest = lines.iter().max_by_key(|l| l.ids.len()).unwrap();
    assert!(longest.ids.len() > 128, "{}", longest.ids.len());
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let program = model.program(1, longest.ids.len());
    let rows = BatchRows::Tokens(vec![longest.ids.clone()]);
    let got = backend.run_eager(model, &weights, &program, &rows).unwrap();
    let c = cosine(&got, &longest.embedding);
    assert!(c >= 0.9999, "cosine {c}");
}

#[test]
fn minilm_padding_never_changes_an_embedding() {
    let model = minilm();
    let lines = minilm_reference();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    // A text of a few dozen tokens, and companions of other lengths.
    let target = lines
        .iter()
        .find(|l| (20..40).contains(&l.ids.len()))
        .unwrap();
    let others: Vec<Vec<u32>> = lines
        .iter()
        .filter(|l| l.ids.len() <= 64 && l.ids != target.ids)
        .take(7)
        .map(|l| l.ids.clone())
        .collect();
    let exact = backend
        .run_eager(
            model,
            &weights,
            &model.program(1, target.ids.len()),
            &BatchRows::Tokens(vec![target.ids.clone()]),
        )
        .unwrap();
    assert!(cosine(&exact, &target.embedding) >= 0.9999);
    let mut g4 = backend
        .capture(model, &weights, &model.program(4, 64))
        .unwrap();
    let mut g8 = backend
        .capture(model, &weights, &model.program(8, 128))
        .unwrap();
    // Padded to the whole bucket, then (the default) computing real rows only.
    for trim in [false, true] {
        backend.set_trim_padding(trim);
        // In a (4, 64) graph, second of three rows (one padded row).
        let rows = BatchRows::Tokens(vec![
            others[0].clone(),
            target.ids.clone(),
            others[1].clone(),
        ]);
        let p = backend.launch(&mut g4, &rows).unwrap();
        let in4 = backend.collect(p).unwrap()[384..768].to_vec();
        // In an (8, 128) graph, last of eight rows.
        let mut seqs = others.clone();
        seqs.push(target.ids.clone());
        let p = backend.launch(&mut g8, &BatchRows::Tokens(seqs)).unwrap();
        let in8 = backend.collect(p).unwrap()[7 * 384..].to_vec();
        for (name, other) in [("(4, 64)", &in4), ("(8, 128)", &in8)] {
            let max = exact
                .iter()
                .zip(other.iter())
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            eprintln!("padding invariance {name}, trim {trim}: max difference {max:e}");
            assert!(max < 1e-5, "{name}, trim {trim}: max difference {max}");
        }
    }
}

#[test]
fn minilm_f16_weights_stay_close() {
    let mut config = model_config(ModelKind::Bert, &model_dir());
    config.dtype = DType::F16;
    let mut model = minilm().clone();
    model.info.dtype = config.dtype;
    let lines = minilm_reference();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(&model).unwrap();
    assert_eq!(weights.dtype(), DType::F16);
    let sample: Vec<&MiniLmLine> = lines.iter().filter(|l| l.ids.len() <= 32).take(8).collect();
    let mut graph = backend
        .capture(&model, &weights, &model.program(8, 32))
        .unwrap();
    let rows = BatchRows::Tokens(sample.iter().map(|l| l.ids.clone()).collect());
    let p = backend.launch(&mut graph, &rows).unwrap();
    let got = backend.collect(p).unwrap();
    for (emb, line) in got.chunks_exact(384).zip(&sample) {
        let c = cosine(emb, &line.embedding);
        assert!(c >= 0.999, "{:?}: {c}", line.text);
    }
}

#[test]
fn minilm_bad_token_batches_are_invalid() {
    let model = minilm();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let program = model.program(2, 16);
    let facts = program.validate(&model.weights).unwrap();
    let mut graph = backend.capture(model, &weights, &program).unwrap();
    let bad = [
        BatchRows::Tokens(vec![vec![101, 102]; 3]),
        BatchRows::Tokens(vec![vec![101; 17]]),
        BatchRows::Tokens(vec![vec![101, 30522, 102]]),
        BatchRows::Tokens(vec![vec![101, u32::MAX, 102]]),
        BatchRows::Features {
            features: 384,
            data: vec![0.0; 384],
        },
    ];
    for rows in &bad {
        assert!(facts.check_rows(rows).is_err(), "{rows:?}");
    }
    // Empty sequences are not an error: no token to pool gives zeros.
    for trim in [true, false] {
        backend.set_trim_padding(trim);
        let p = backend
            .launch(&mut graph, &BatchRows::Tokens(vec![vec![], vec![101, 102]]))
            .unwrap();
        let out = backend.collect(p).unwrap();
        assert!(out[..384].iter().all(|&v| v == 0.0));
        assert!((out[384..].iter().map(|v| v * v).sum::<f32>() - 1.0).abs() < 1e-5);
    }
    // Programs the model cannot run are refused before capture, not at replay.
    let too_long = model.program(1, 513);
    assert!(too_long.validate(&model.weights).is_err());
    assert_eq!(
        model
            .program(2, 16)
            .input(InputRole::AttentionMask)
            .map(|b| b.0),
        Some(1)
    );
}

/// One model's program and a batch for it.
struct Case<'a> {
    model: &'a Model,
    program: crate::model::Program,
    rows: BatchRows,
}

/// Captures `case` in a fresh backend and runs it once there.
fn run_alone(case: &Case, trim: bool) -> Vec<f32> {
    let mut backend = CpuBackend::new(0, THREADS);
    backend.set_trim_padding(trim);
    let weights = backend.upload(case.model).unwrap();
    let mut graph = backend
        .capture(case.model, &weights, &case.program)
        .unwrap();
    let p = backend.launch(&mut graph, &case.rows).unwrap();
    backend.collect(p).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Graphs of two models and several sizes share one activation arena: replayed
/// alternately (each overwriting the others' activations) they give exactly
/// what each gives captured alone, and the backend holds the largest graph's
/// activations once instead of every graph's.
#[test]
fn graphs_of_two_models_share_one_arena() {
    let bert = minilm();
    let mlp = mlp_model();
    let lines = minilm_reference();
    let mut rng = StdRng::seed_from_u64(5);
    let tokens = |batch: usize, seq: usize| {
        BatchRows::Tokens(
            lines
                .iter()
                .filter(|l| l.ids.len() <= seq)
                .take(batch.max(2) - 1)
                .map(|l| l.ids.clone())
                .collect(),
        )
    };
    let mut features = |batch: usize| {
        let n = batch.max(2) - 1;
        BatchRows::Features {
            features: 128,
            data: (0..n * 128)
                .map(|_| rng.random_range(-3.0f32..3.0))
                .collect(),
        }
    };
    // Captured smallest first, mixed, so that the arena grows several times.
    let mut cases = vec![
        Case {
            model: &mlp,
            program: mlp.program(4, 1),
            rows: features(4),
        },
        Case {
            model: bert,
            program: bert.program(2, 16),
            rows: tokens(2, 16),
        },
        Case {
            model: bert,
            program: bert.program(8, 64),
            rows: tokens(8, 64),
        },
        Case {
            model: &mlp,
            program: mlp.program(64, 1),
            rows: features(64),
        },
        Case {
            model: bert,
            program: bert.program(4, 32),
            rows: tokens(4, 32),
        },
        Case {
            model: bert,
            program: bert.program(8, 32),
            rows: tokens(8, 32),
        },
        Case {
            model: bert,
            program: bert.program(4, 64),
            rows: tokens(4, 64),
        },
    ];
    // A full batch too, in the largest graph.
    cases[2].rows = BatchRows::Tokens(
        lines
            .iter()
            .filter(|l| l.ids.len() <= 64)
            .skip(20)
            .take(8)
            .map(|l| l.ids.clone())
            .collect(),
    );

    let mut backend = CpuBackend::new(0, THREADS);
    assert_eq!(backend.arena_bytes(), 0);
    let bert_weights = backend.upload(bert).unwrap();
    let mlp_weights = backend.upload(&mlp).unwrap();
    let mut graphs = Vec::new();
    let mut grew = 0;
    for case in &cases {
        let weights = if std::ptr::eq(case.model, bert) {
            &bert_weights
        } else {
            &mlp_weights
        };
        let before = backend.arena_bytes();
        graphs.push(backend.capture(case.model, weights, &case.program).unwrap());
        grew += usize::from(backend.arena_bytes() > before);
    }
    assert!(grew >= 3, "the arena grew {grew} times");

    for trim in [true, false] {
        let alone: Vec<Vec<f32>> = cases.iter().map(|c| run_alone(c, trim)).collect();
        backend.set_trim_padding(trim);
        // Twice round, in two orders: every graph runs right after others.
        let order: Vec<usize> = (0..cases.len()).chain((0..cases.len()).rev()).collect();
        for &i in &order {
            let p = backend.launch(&mut graphs[i], &cases[i].rows).unwrap();
            let got = backend.collect(p).unwrap();
            assert_eq!(
                bits(&got),
                bits(&alone[i]),
                "graph {i} ({}, {}), trim {trim}",
                graphs[i].batch(),
                graphs[i].seq()
            );
        }
    }

    // Memory: one arena, as large as the largest need, not the sum of them.
    let needs: Vec<arena::ArenaNeeds> = graphs.iter().map(|g| g.plan.arena_needs()).collect();
    let largest = needs.iter().map(|n| n.activations).max().unwrap()
        + needs.iter().map(|n| n.scratch).max().unwrap();
    assert_eq!(backend.arena_bytes(), largest as u64 * 4);
    let needed: u64 = graphs.iter().map(CpuGraph::arena_needed_bytes).sum();
    let statics: u64 = graphs.iter().map(CpuGraph::static_bytes).sum();
    let reported: u64 = graphs.iter().map(|g| backend.graph_memory_bytes(g)).sum();
    eprintln!(
        "arena {} bytes for {} graphs needing {needed} bytes in all; static {statics} bytes",
        backend.arena_bytes(),
        graphs.len()
    );
    assert!(backend.arena_bytes() * 2 < needed);
    // The graphs' figures add up to what the backend holds.
    assert_eq!(reported, statics + backend.arena_bytes());
    // The largest graph needs the whole arena's activations.
    assert_eq!(
        graphs[2].arena_needed_bytes(),
        (needs[2].activations + needs[2].scratch) as u64 * 4
    );
    assert!(graphs[2].arena_needed_bytes() <= backend.arena_bytes());

    // Eager runs: one that fits uses the arena, one larger than every graph
    // uses memory of its own and leaves the arena as it was.
    let arena = backend.arena_bytes();
    backend.set_trim_padding(true);
    for (batch, seq) in [(1, 16), (16, 64)] {
        let case = Case {
            model: bert,
            program: bert.program(batch, seq),
            rows: tokens(batch + 1, seq),
        };
        let got = backend
            .run_eager(bert, &bert_weights, &case.program, &case.rows)
            .unwrap();
        assert_eq!(
            bits(&got),
            bits(&run_alone(&case, true)),
            "eager ({batch}, {seq})"
        );
        assert_eq!(backend.arena_bytes(), arena, "eager ({batch}, {seq})");
    }
    // And the graphs still give the same results afterwards.
    let p = backend.launch(&mut graphs[1], &cases[1].rows).unwrap();
    assert_eq!(
        bits(&backend.collect(p).unwrap()),
        bits(&run_alone(&cases[1], true))
    );
}

/// A program that reads an activation before writing it would see whatever
/// another graph left in the shared arena: validation refuses it.
#[test]
fn reading_an_unwritten_activation_is_refused_at_capture() {
    let mlp = mlp_model();
    let mut program = mlp.program(4, 1);
    program.ops.reverse();
    let err = program.validate(&mlp.weights).unwrap_err();
    assert!(err.to_string().contains("before any op writes it"), "{err}");
}

/// Steady-state throughput at (32, 128) on 128-token texts and on real
/// texts (padded, and with the padding trimmed), for comparing changes by hand:
/// `cargo test --release --lib minilm_throughput_32x128 -- --ignored --nocapture`
/// (`REPLAYD_BENCH_ITERS` replays per case, default 10, after one warm-up;
/// `REPLAYD_BENCH_THREADS` threads, default 2). Besides wall time it prints
/// the CPU time the process spent per replay (all threads), which is less
/// sensitive to other load on a shared machine.
#[test]
#[ignore = "benchmark, run by hand"]
fn minilm_throughput_32x128() {
    let model = minilm();
    let lines = minilm_reference();
    let env = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let iters = env("REPLAYD_BENCH_ITERS", 10).max(1);
    let threads = env("REPLAYD_BENCH_THREADS", THREADS);
    // On-CPU nanoseconds of every thread of this process (Linux; 0 elsewhere).
    let cpu_ns = || -> u64 {
        std::fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|task| std::fs::read_to_string(task.path().join("schedstat")).ok())
            .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .sum()
    };
    let mut backend = CpuBackend::new(0, threads);
    let weights = backend.upload(model).unwrap();
    let mut graph = backend
        .capture(model, &weights, &model.program(32, 128))
        .unwrap();
    let full = BatchRows::Tokens(vec![
        lines[5].ids.iter().copied().cycle().take(128).collect();
        32
    ]);
    let real = BatchRows::Tokens(
        lines
            .iter()
            .skip(10)
            .take(32)
            .map(|l| l.ids.clone())
            .collect(),
    );
    for (name, rows, trim) in [
        ("128-token texts", &full, true),
        ("reference texts, padded", &real, false),
        ("reference texts", &real, true),
    ] {
        backend.set_trim_padding(trim);
        let p = backend.launch(&mut graph, rows).unwrap();
        backend.collect(p).unwrap();
        let (mut times, mut cpu): (Vec<f64>, Vec<f64>) = (0..iters)
            .map(|_| {
                let (start, cpu_start) = (Instant::now(), cpu_ns());
                let p = backend.launch(&mut graph, rows).unwrap();
                backend.collect(p).unwrap();
                let wall = start.elapsed().as_secs_f64();
                (wall, (cpu_ns() - cpu_start) as f64 * 1e-9)
            })
            .unzip();
        times.sort_by(f64::total_cmp);
        cpu.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        let mean = times.iter().sum::<f64>() / times.len() as f64;
        eprintln!(
            "bench minilm cpu ({threads} threads) (32, 128) {name}, trim {trim}: \
             median {:.1} ms (min {:.1}, mean {:.1}, {iters} runs), {:.1} texts/s at the median; \
             cpu time median {:.1} ms (min {:.1})",
            median * 1e3,
            times[0] * 1e3,
            mean * 1e3,
            32.0 / median,
            cpu[cpu.len() / 2] * 1e3,
            cpu[0] * 1e3
        );
    }
}

/// Memory of the default MiniLM grid captured in one backend, largest first:
/// `cargo test --release --lib minilm_default_grid_memory -- --ignored --nocapture`.
#[test]
#[ignore = "measurement, run by hand"]
fn minilm_default_grid_memory() {
    let model = minilm();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let mut graphs = Vec::new();
    for &batch in [1, 2, 4, 8, 16, 32, 64, 128].iter().rev() {
        for &seq in SEQ_BUCKETS.iter().rev() {
            graphs.push(
                backend
                    .capture(model, &weights, &model.program(batch, seq))
                    .unwrap(),
            );
        }
    }
    let reported: u64 = graphs.iter().map(|g| backend.graph_memory_bytes(g)).sum();
    let statics: u64 = graphs.iter().map(CpuGraph::static_bytes).sum();
    let needed: u64 = graphs.iter().map(CpuGraph::arena_needed_bytes).sum();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "minilm default grid: {} graphs, sum of graph_memory_bytes {:.1} MiB: \
         static buffers {:.1} MiB + shared arena {:.1} MiB \
         (the graphs' activations and scratch, each on its own, would be {:.1} MiB)",
        graphs.len(),
        mib(reported),
        mib(statics),
        mib(backend.arena_bytes()),
        mib(needed)
    );
}

mod packed;
