//! Packed programs on the CPU backend: against the padded ones of the same
//! model for every pooling, against sentence-transformers and the f64
//! reference interpreter, their bad batches, and one arena shared with
//! padded graphs.

use super::*;
use crate::bucket::{Bucket, TokenGrid};
use crate::model::bert::{BertArch, SyntheticSizes};
use crate::model::{InputSpec, ModelInfo, Pooling};

/// MiniLM with its pooling (and normalisation) overridden, as a config's
/// `pooling`/`normalize` keys do.
fn minilm_with(pooling: Pooling, normalize: bool) -> Model {
    let mut model = minilm().clone();
    let Architecture::Bert(arch) = &mut model.arch else {
        unreachable!()
    };
    arch.pooling = pooling;
    arch.normalize = normalize;
    model
}

/// A text of exactly `len` ids: `[CLS]`, words of a reference text
/// (repeated as needed), `[SEP]` (just `[CLS]` for length 1).
fn text_of_len(len: usize, salt: usize) -> Vec<u32> {
    let lines = minilm_reference();
    let body = &lines[salt % lines.len()..]
        .iter()
        .chain(lines)
        .find(|l| l.ids.len() > 2)
        .unwrap()
        .ids;
    let words = &body[1..body.len() - 1];
    let mut ids = vec![101u32];
    ids.extend(words.iter().copied().cycle().take(len.saturating_sub(2)));
    if len >= 2 {
        ids.push(102);
    }
    assert_eq!(ids.len(), len);
    ids
}

/// Max |a − b| and min cosine over rows of `dim` (rows of zeros in both
/// count as cosine 1).
fn agreement(a: &[f32], b: &[f32], dim: usize) -> (f32, f64) {
    assert_eq!(a.len(), b.len());
    let max = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    let cos = a
        .chunks(dim)
        .zip(b.chunks(dim))
        .map(|(x, y)| {
            if x.iter().chain(y).all(|&v| v == 0.0) {
                1.0
            } else {
                cosine(x, y)
            }
        })
        .fold(f64::INFINITY, f64::min);
    (max, cos)
}

fn launch_once(backend: &mut CpuBackend, graph: &mut CpuGraph, rows: &BatchRows) -> Vec<f32> {
    let p = backend.launch(graph, rows).unwrap();
    backend.collect(p).unwrap()
}

/// The packed program of a MiniLM bucket, validated.
fn packed_graph(
    backend: &mut CpuBackend,
    model: &Model,
    weights: &CpuWeights,
    tokens: usize,
    seqs: usize,
) -> (CpuGraph, crate::model::ProgramFacts) {
    let program = model.program_for(Bucket::packed(tokens, seqs)).unwrap();
    let facts = program.validate(&model.weights).unwrap();
    (backend.capture(model, weights, &program).unwrap(), facts)
}

/// Packed and padded MiniLM agree on the same texts for every pooling: one
/// batch of sequences of 1 … 256 tokens, a budget filled exactly, one with
/// unused sequence slots, a nearly empty one, and empty sequences; trimmed
/// and full replays.
#[test]
fn minilm_packed_matches_padded_for_every_pooling() {
    let lens = [1usize, 2, 3, 7, 16, 17, 31, 64, 100, 128, 200, 255, 256];
    let texts: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| text_of_len(l, 7 * i + 3))
        .collect();
    let total: usize = lens.iter().sum();
    let mut worst = (0.0f32, 1.0f64);
    for (pooling, normalize) in [
        (Pooling::Mean, true),
        (Pooling::Cls, true),
        (Pooling::Max, true),
        (Pooling::Mean, false),
    ] {
        let model = minilm_with(pooling, normalize);
        let mut backend = CpuBackend::new(0, THREADS);
        let weights = backend.upload(&model).unwrap();
        let rows = BatchRows::Tokens(texts.clone());
        // Padded: one (13, 256) graph (a replay computes 13 × 256 tokens).
        let mut padded = backend
            .capture(&model, &weights, &model.program(lens.len(), 256))
            .unwrap();
        let want = launch_once(&mut backend, &mut padded, &rows);
        // Packed, the budget filled exactly with exactly its sequences.
        let (mut exact, facts) = packed_graph(&mut backend, &model, &weights, total, lens.len());
        facts.check_rows(&rows).unwrap();
        let got = launch_once(&mut backend, &mut exact, &rows);
        let (max, cos) = agreement(&got, &want, 384);
        eprintln!(
            "packed vs padded, {pooling:?} normalize {normalize}, {} tokens: max |diff| {max:.2e}, min cos 1 - {:.2e}",
            total,
            1.0 - cos
        );
        assert!(max < 1e-5 && cos >= 0.99999, "{pooling:?}: {max} {cos}");
        worst = (worst.0.max(max), worst.1.min(cos));
        // Full replays (the tail and unused slots computed too) agree with trimmed ones.
        backend.set_trim_padding(false);
        let full = launch_once(&mut backend, &mut exact, &rows);
        backend.set_trim_padding(true);
        let (max, _) = agreement(&full, &got, 384);
        assert!(max < 1e-5, "{pooling:?} full vs trimmed: {max}");
        if pooling != Pooling::Mean || !normalize {
            continue;
        }
        // A larger budget with unused sequence slots and a long tail, full
        // and trimmed; empty sequences give zero rows and leave the others alone.
        let (mut roomy, facts) = packed_graph(&mut backend, &model, &weights, 2048, 64);
        let mut with_empty = texts.clone();
        with_empty.insert(0, vec![]);
        with_empty.insert(5, vec![]);
        with_empty.push(vec![]);
        let rows_e = BatchRows::Tokens(with_empty.clone());
        facts.check_rows(&rows_e).unwrap();
        for trim in [true, false] {
            backend.set_trim_padding(trim);
            let out = launch_once(&mut backend, &mut roomy, &rows_e);
            assert_eq!(out.len(), with_empty.len() * 384);
            let mut k = 0;
            for (i, ids) in with_empty.iter().enumerate() {
                let row = &out[i * 384..(i + 1) * 384];
                if ids.is_empty() {
                    assert!(row.iter().all(|&v| v == 0.0), "empty row {i}");
                } else {
                    let (max, cos) = agreement(row, &want[k * 384..(k + 1) * 384], 384);
                    assert!(
                        max < 1e-5 && cos >= 0.99999,
                        "row {i} trim {trim}: {max} {cos}"
                    );
                    k += 1;
                }
            }
        }
        backend.set_trim_padding(true);
        // A nearly empty budget: one short text, then only [CLS], then only empty sequences.
        for (rows_n, i) in [
            (BatchRows::Tokens(vec![texts[4].clone()]), 4),
            (BatchRows::Tokens(vec![texts[0].clone()]), 0),
        ] {
            for trim in [true, false] {
                backend.set_trim_padding(trim);
                let out = launch_once(&mut backend, &mut roomy, &rows_n);
                let (max, cos) = agreement(&out, &want[i * 384..(i + 1) * 384], 384);
                assert!(max < 1e-5 && cos >= 0.99999, "alone {i} trim {trim}: {max}");
            }
        }
        for trim in [true, false] {
            backend.set_trim_padding(trim);
            let out = launch_once(
                &mut backend,
                &mut roomy,
                &BatchRows::Tokens(vec![vec![]; 3]),
            );
            assert_eq!(out, vec![0.0; 3 * 384]);
        }
        backend.set_trim_padding(true);
    }
    eprintln!(
        "packed vs padded, all poolings: max |diff| {:.2e}, min cos 1 - {:.2e}",
        worst.0,
        1.0 - worst.1
    );
}

/// A packed eager run (the program at the batch's exact token count) is the
/// packed graph's result, and packing cannot change an embedding: a text
/// gives the same vector wherever it lies in the budget.
#[test]
fn minilm_packed_eager_and_position_in_the_budget() {
    let model = minilm();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let target = text_of_len(29, 11);
    let others: Vec<Vec<u32>> = (0..6).map(|i| text_of_len(9 + 13 * i, i)).collect();
    let alone = BatchRows::Tokens(vec![target.clone()]);
    let program = model.eager_program(&alone, true);
    assert!(program.is_packed());
    assert_eq!(
        (program.token_slots(), program.batch, program.seq),
        (29, 1, 29)
    );
    program.validate(&model.weights).unwrap();
    let exact = backend
        .run_eager(model, &weights, &program, &alone)
        .unwrap();
    let padded = backend
        .run_eager(model, &weights, &model.eager_program(&alone, false), &alone)
        .unwrap();
    let (max, _) = agreement(&exact, &padded, 384);
    assert!(max < 1e-5, "packed vs padded eager: {max}");
    let (mut g, _) = packed_graph(&mut backend, model, &weights, 512, 16);
    for at in [0, 3, 6] {
        let mut seqs = others.clone();
        seqs.insert(at, target.clone());
        let rows = BatchRows::Tokens(seqs);
        let out = launch_once(&mut backend, &mut g, &rows);
        let (max, _) = agreement(&out[at * 384..(at + 1) * 384], &exact, 384);
        assert!(max < 1e-5, "at {at}: {max}");
        // The eager packed program of the whole batch agrees with the graph.
        let program = model.eager_program(&rows, true);
        let eager = backend.run_eager(model, &weights, &program, &rows).unwrap();
        let (max, _) = agreement(&eager, &out, 384);
        assert!(max < 1e-5, "eager vs graph at {at}: {max}");
    }
}

/// The 300 sentence-transformers references through packed graphs, batched
/// as the daemon batches them (texts in order into the smallest budget of a
/// ladder that holds them, at most 64 per graph).
#[test]
fn minilm_all_300_reference_embeddings_through_packed_graphs() {
    let model = minilm();
    let lines = minilm_reference();
    let grid = TokenGrid::new(vec![64, 256, 1024, 2048], 64);
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let mut graphs: HashMap<Bucket, (CpuGraph, crate::model::ProgramFacts)> = HashMap::new();
    for bucket in grid.largest_first() {
        let Bucket::Packed { tokens, seqs } = bucket else {
            unreachable!()
        };
        graphs.insert(
            bucket,
            packed_graph(&mut backend, model, &weights, tokens, seqs),
        );
    }
    let start = Instant::now();
    let mut got: Vec<Vec<f32>> = Vec::new();
    let mut used = std::collections::BTreeMap::new();
    let mut i = 0;
    while i < lines.len() {
        let (mut tokens, mut j) = (0, i);
        while j < lines.len()
            && grid
                .bucket_for(tokens + lines[j].ids.len(), j + 1 - i)
                .is_some()
        {
            tokens += lines[j].ids.len();
            j += 1;
        }
        let bucket = grid.bucket_for(tokens, j - i).unwrap();
        *used.entry(bucket.to_string()).or_insert(0) += 1;
        let rows = BatchRows::Tokens(lines[i..j].iter().map(|l| l.ids.clone()).collect());
        let (graph, facts) = graphs.get_mut(&bucket).unwrap();
        facts.check_rows(&rows).unwrap();
        let out = launch_once(&mut backend, graph, &rows);
        got.extend(out.chunks_exact(384).map(<[f32]>::to_vec));
        i = j;
    }
    let elapsed = start.elapsed();
    let mut worst = (f64::INFINITY, 0usize);
    for (k, (line, emb)) in lines.iter().zip(&got).enumerate() {
        let c = cosine(emb, &line.embedding);
        if c < worst.0 {
            worst = (c, k);
        }
        assert!(c >= 0.9999, "line {k} {:?}: cosine {c}", line.text);
    }
    assert_eq!(got.len(), 300);
    eprintln!(
        "minilm packed: 300 reference texts in {:.2} s through {used:?}; worst cosine 1 - {:.2e} (line {})",
        elapsed.as_secs_f64(),
        1.0 - worst.0,
        worst.1
    );
}

/// A small BERT with random weights, built as the folder loader would
/// (`hidden`, `heads`, two layers, vocab 50, 48 positions, longest input 40).
fn synthetic_bert(hidden: usize, heads: usize, pooling: Pooling, seed: u64) -> Model {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = crate::model::Weights::new();
    let (vocab, npos) = (50, 48);
    let sizes = SyntheticSizes {
        layers: 2,
        hidden,
        heads,
        intermediate: 2 * hidden,
        vocab,
        positions: npos,
        max_seq_len: 40,
        pooling,
        normalize: pooling != Pooling::Max,
    };
    let arch = BertArch::synthetic(sizes, |name, shape| {
        // The embeddings' own scales; each layer's weights 2/√fan-in.
        let scale = match name {
            "word" | "position" => 1.0,
            "token_type" | "emb.b" => 0.5,
            "emb.g" => 1.5,
            _ => 2.0 / (*shape.last().unwrap() as f32).sqrt(),
        };
        let n = shape.iter().product();
        let data = (0..n).map(|_| rng.random_range(-scale..scale)).collect();
        w.push(name, shape, data)
    });
    Model {
        info: ModelInfo {
            name: "synthetic".into(),
            kind: ModelKind::Bert,
            input: InputSpec::Tokens {
                vocab_size: vocab,
                max_seq_len: 40,
            },
            output_dim: hidden,
            dtype: DType::F32,
            tokenizer_path: None,
            task: Default::default(),
            tokenizer: None,
            prompts: Default::default(),
            derived: Vec::new(),
            normalized: false,
            truncate_dim: None,
            matryoshka: Default::default(),
        },
        arch: Architecture::Bert(arch),
        weights: w,
    }
}

/// Random sequences of the given lengths over a vocabulary of 50.
fn random_seqs(lens: &[usize], rng: &mut StdRng) -> BatchRows {
    BatchRows::Tokens(
        lens.iter()
            .map(|&l| (0..l).map(|_| rng.random_range(0..50u32)).collect())
            .collect(),
    )
}

/// The CPU backend's packed programs against the f64 reference interpreter
/// on synthetic encoders (head sizes 8 and 5, every pooling, f32/f16/bf16
/// weights), trimmed and full, in graphs and eagerly.
#[test]
fn packed_programs_match_the_f64_reference() {
    let mut rng = StdRng::seed_from_u64(17);
    let mut worst = 0.0f64;
    let mut checks = 0;
    for (hidden, heads, pooling, dtype) in [
        (24, 3, Pooling::Mean, DType::F32),
        (24, 3, Pooling::Cls, DType::F16),
        (15, 3, Pooling::Max, DType::F32),
        (15, 3, Pooling::Mean, DType::BF16),
    ] {
        let mut model = synthetic_bert(hidden, heads, pooling, 5 + hidden as u64);
        model.info.dtype = dtype;
        let mut backend = CpuBackend::new(0, THREADS);
        let weights = backend.upload(&model).unwrap();
        let (tokens, seqs) = (96, 9);
        let program = model.program_for(Bucket::packed(tokens, seqs)).unwrap();
        assert_eq!(program.seq, 40);
        let facts = program.validate(&model.weights).unwrap();
        let mut graph = backend.capture(&model, &weights, &program).unwrap();
        for lens in [
            vec![40, 40, 16],            // filled exactly, longest allowed
            vec![1],                     // nearly empty
            vec![3, 0, 17, 1, 0, 25, 2], // empty sequences, a tail
            vec![1; 9],                  // as many sequences as slots
            vec![0, 0],                  // nothing at all
        ] {
            let rows = random_seqs(&lens, &mut rng);
            facts.check_rows(&rows).unwrap();
            let want: Vec<f64> =
                crate::model::program::reference::run(&program, &model.weights, dtype, &rows)
                    .iter()
                    .map(|&v| v as f64)
                    .collect();
            let eager_program = model.eager_program(&rows, true);
            eager_program.validate(&model.weights).unwrap();
            for trim in [true, false] {
                backend.set_trim_padding(trim);
                let got = launch_once(&mut backend, &mut graph, &rows);
                let eager = backend
                    .run_eager(&model, &weights, &eager_program, &rows)
                    .unwrap();
                for out in [&got, &eager] {
                    assert_eq!(out.len(), lens.len() * hidden);
                    let err = out
                        .iter()
                        .zip(&want)
                        .map(|(&g, &w)| (g as f64 - w).abs())
                        .fold(0.0, f64::max);
                    worst = worst.max(err);
                    checks += 1;
                    assert!(
                        err < 2e-5,
                        "{hidden}/{heads} {pooling:?} {dtype} {lens:?} trim {trim}: {err}"
                    );
                    for (r, &l) in lens.iter().enumerate() {
                        if l == 0 {
                            assert!(out[r * hidden..(r + 1) * hidden].iter().all(|&v| v == 0.0));
                        }
                    }
                }
            }
            backend.set_trim_padding(true);
        }
    }
    eprintln!("packed vs f64 reference: {checks} checks, max |diff| {worst:.2e}");
}

/// Bad packed batches are refused by the graph's facts before a replay, and
/// packed programs the model cannot run are refused at validation.
#[test]
fn minilm_bad_packed_batches_are_invalid() {
    let model = minilm();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let (mut graph, facts) = packed_graph(&mut backend, model, &weights, 64, 4);
    assert_eq!((facts.batch, facts.seq, facts.tokens), (4, 64, Some(64)));
    for rows in [
        BatchRows::Tokens(vec![vec![101; 40], vec![101; 25]]), // 65 tokens
        BatchRows::Tokens(vec![vec![101, 102]; 5]),            // 5 sequences
        BatchRows::Tokens(vec![vec![101, 30522, 102]]),
        BatchRows::Tokens(vec![]),
    ] {
        assert!(facts.check_rows(&rows).is_err(), "{rows:?}");
    }
    let ok = BatchRows::Tokens(vec![vec![101; 40], vec![101; 24]]);
    facts.check_rows(&ok).unwrap();
    assert_eq!(launch_once(&mut backend, &mut graph, &ok).len(), 2 * 384);
    // The budget's longest sequence is the model's max_seq_len (256) at most.
    let p = model.program_for(Bucket::packed(4096, 64)).unwrap();
    assert_eq!(p.validate(&model.weights).unwrap().seq, 256);
    // Longer than the position table (512): refused.
    let mut p = model.program_for(Bucket::packed(1024, 4)).unwrap();
    p.seq = 513;
    use crate::model::program::Seqs;
    for op in &mut p.ops {
        if let Some(Seqs::Packed { max_seq_len, .. }) = op.seqs_mut() {
            *max_seq_len = 513;
        }
    }
    assert!(p.validate(&model.weights).is_err());
    // MLPs have no packed programs.
    assert!(mlp_model().program_for(Bucket::packed(64, 4)).is_err());
}

/// Packed and padded graphs share one arena (activations and the attention
/// scratch, which a packed graph sizes by its longest sequence): replayed
/// alternately they give exactly what each gives captured alone.
#[test]
fn packed_and_padded_graphs_share_one_arena() {
    let model = minilm();
    let texts: Vec<Vec<u32>> = (0..5).map(|i| text_of_len(5 + 17 * i, 3 * i)).collect();
    let cases = [
        Case {
            model,
            program: model.program_for(Bucket::packed(512, 16)).unwrap(),
            rows: BatchRows::Tokens(texts.clone()),
        },
        Case {
            model,
            program: model.program(4, 128),
            rows: BatchRows::Tokens(texts[..4].to_vec()),
        },
        Case {
            model,
            program: model.program_for(Bucket::packed(64, 8)).unwrap(),
            rows: BatchRows::Tokens(vec![texts[1].clone(), vec![], texts[0].clone()]),
        },
    ];
    let alone: Vec<Vec<f32>> = cases.iter().map(|c| run_alone(c, true)).collect();
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(model).unwrap();
    let mut graphs: Vec<CpuGraph> = cases
        .iter()
        .map(|c| backend.capture(model, &weights, &c.program).unwrap())
        .collect();
    let needs: Vec<arena::ArenaNeeds> = graphs.iter().map(|g| g.plan.arena_needs()).collect();
    // The packed 512-token graph's scratch: 2 workers × 256² scores.
    assert_eq!(needs[0].scratch, THREADS * 256 * 256);
    assert_eq!(
        backend.arena_bytes(),
        (needs.iter().map(|n| n.activations).max().unwrap()
            + needs.iter().map(|n| n.scratch).max().unwrap()) as u64
            * 4
    );
    for &i in &[0, 1, 2, 0, 2, 1, 0] {
        let got = launch_once(&mut backend, &mut graphs[i], &cases[i].rows);
        assert_eq!(bits(&got), bits(&alone[i]), "graph {i}");
    }
}

/// ModernBERT's ops (rotary positions, sliding-window attention, the gated
/// unit, pre-norm LayerNorms without bias, residual adds) on the CPU backend
/// against the f64 reference interpreter, padded and packed, trimmed and
/// full, with sequences longer than its ±4-token window and empty ones.
#[test]
fn modernbert_programs_match_the_f64_reference() {
    let dir = reference_dir().join("models/modernbert-st");
    let model =
        crate::model::Model::load(&ModelSpec::new("modernbert", ModelKind::Bert, dir)).unwrap();
    let Architecture::RotaryEncoder(arch) = &model.arch else {
        panic!("not read as ModernBERT")
    };
    assert_eq!(
        arch.layers.iter().map(|l| l.window).collect::<Vec<_>>(),
        [None, Some(4), Some(4), None]
    );
    let mut backend = CpuBackend::new(0, THREADS);
    let weights = backend.upload(&model).unwrap();
    let mut rng = StdRng::seed_from_u64(23);
    for (bucket, lens) in [
        (Bucket::packed(64, 5), vec![20, 1, 30, 0, 9]),
        (Bucket::packed(64, 5), vec![12]),
        (Bucket::Padded { batch: 3, seq: 24 }, vec![24, 3, 11]),
    ] {
        let program = model.program_for(bucket).unwrap();
        let facts = program.validate(&model.weights).unwrap();
        let mut graph = backend.capture(&model, &weights, &program).unwrap();
        let rows = random_seqs(&lens, &mut rng);
        facts.check_rows(&rows).unwrap();
        let want =
            crate::model::program::reference::run(&program, &model.weights, DType::F32, &rows);
        for trim in [true, false] {
            backend.set_trim_padding(trim);
            let got = launch_once(&mut backend, &mut graph, &rows);
            assert_eq!(got.len(), want.len());
            let err = got
                .iter()
                .zip(&want)
                .map(|(&g, &w)| (g - w).abs())
                .fold(0.0f32, f32::max);
            assert!(err < 2e-5, "{bucket} {lens:?} trim {trim}: {err}");
        }
    }
}
