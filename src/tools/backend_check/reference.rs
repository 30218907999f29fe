//! `--reference NAME=FILE.jsonl`: stored outputs (e.g. sentence-transformers
//! embeddings of real texts, or MLP batches) run through a model's captured
//! graphs, batched as the daemon would batch them, and compared.
//!
//! Texts go to padded graphs grouped by the seq bucket they fall into, to
//! packed graphs in file order into the smallest budget that holds them;
//! what no graph holds runs on the eager path.

use std::ops::Range;
use std::path::Path;

use anyhow::{anyhow, bail, Context};

use super::compare::{compare, threshold};
use super::context::{Ctx, Subject};
use super::report::ReferenceResult;
use crate::backend::cuda::CapturedGraph;
use crate::backend::Backend;
use crate::bucket::Bucket;
use crate::config::BatchingMode;
use crate::model::{BatchRows, InputSpec, Model, ModelKind};

/// One reference item: token ids and embedding, or an MLP batch.
enum RefItem {
    Tokens(Vec<u32>, Vec<f32>),
    Batch(Vec<Vec<f32>>, Vec<Vec<f32>>),
}

/// Reads a reference file. Lines with `text` instead of `ids` (what
/// scripts/bench/torch-baseline.py writes) are tokenized with the model's own
/// tokenizer, as the daemon would.
fn read_reference(path: &Path, model: &Model) -> anyhow::Result<Vec<RefItem>> {
    let mut tokenizer = None;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let floats = |v: &serde_json::Value| -> Option<Vec<f32>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_f64().map(|f| f as f32))
            .collect()
    };
    let mut items = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), i + 1))?;
        let bad = || {
            anyhow!(
                "{}:{}: expected ids+embedding, text+embedding or input+output",
                path.display(),
                i + 1
            )
        };
        if let (Some(ids), Some(emb)) = (v.get("ids"), v.get("embedding")) {
            let ids: Vec<u32> = ids
                .as_array()
                .ok_or_else(bad)?
                .iter()
                .map(|x| x.as_u64().map(|u| u as u32))
                .collect::<Option<_>>()
                .ok_or_else(bad)?;
            items.push(RefItem::Tokens(ids, floats(emb).ok_or_else(bad)?));
        } else if let (Some(t), Some(emb)) =
            (v.get("text").and_then(|t| t.as_str()), v.get("embedding"))
        {
            if tokenizer.is_none() {
                let (Some(file), InputSpec::Tokens { max_seq_len, .. }) =
                    (&model.info.tokenizer_path, &model.info.input)
                else {
                    bail!(
                        "{}: texts, but model {} has no tokenizer",
                        path.display(),
                        model.info.name
                    );
                };
                tokenizer = Some(crate::daemon::tokenize::TextTokenizer::load(
                    file,
                    *max_seq_len,
                )?);
            }
            let tok = tokenizer.as_ref().expect("loaded above");
            let ids = tok.encode(&[t], true)?.remove(0);
            items.push(RefItem::Tokens(ids, floats(emb).ok_or_else(bad)?));
        } else if let (Some(inp), Some(out)) = (v.get("input"), v.get("output")) {
            let rows = |x: &serde_json::Value| -> Option<Vec<Vec<f32>>> {
                x.as_array()?.iter().map(floats).collect()
            };
            items.push(RefItem::Batch(
                rows(inp).ok_or_else(bad)?,
                rows(out).ok_or_else(bad)?,
            ));
        } else {
            return Err(bad());
        }
    }
    Ok(items)
}

/// Runs a reference file through the model's graphs (or the eager path)
/// and compares what comes out with the file's outputs.
pub(super) fn check_reference(
    c: &mut Ctx<'_>,
    s: Subject<'_>,
    graphs: &mut [(Bucket, CapturedGraph)],
    path: &Path,
) -> ReferenceResult {
    let mut res = ReferenceResult::new(path);
    let (kind, dim) = (s.mc.kind, s.model.info.output_dim);
    let outputs = read_reference(path, s.model).and_then(|items| match kind {
        ModelKind::Bert => texts_through(c, s, graphs, items, &mut res),
        ModelKind::Mlp => batches_through(c, s, graphs, items, &mut res),
    });
    let (gpu_all, ref_all) = match outputs {
        Ok(o) => o,
        Err(e) => {
            res.error = Some(e.to_string());
            return res;
        }
    };
    let th = threshold(kind, s.mc.dtype, c.gpu.options().allow_tf32);
    if kind == ModelKind::Bert && res.items > 0 {
        let sum: f64 = gpu_all
            .chunks(dim)
            .zip(ref_all.chunks(dim))
            .map(|(g, r)| compare(kind, g, r, dim, th).value)
            .sum();
        res.mean_cosine = Some(sum / res.items as f64);
    }
    res.check = Some(compare(kind, &gpu_all, &ref_all, dim, th));
    res
}

/// (batch, seq) of a padded graph.
fn padded_shape(bucket: Bucket) -> (usize, usize) {
    match bucket {
        Bucket::Padded { batch, seq } => (batch, seq),
        // A padded model captures no packed bucket; this one holds no text.
        Bucket::Packed { seqs, .. } => (seqs, 0),
    }
}

/// The smallest padded graph of `shapes` (batch, seq) that holds `n` rows
/// of `len` tokens.
fn smallest_padded(shapes: &[(usize, usize)], n: usize, len: usize) -> Option<usize> {
    shapes
        .iter()
        .enumerate()
        .filter(|(_, (b, s))| *b >= n && *s >= len)
        .min_by_key(|(_, (b, s))| (*s, *b))
        .map(|(i, _)| i)
}

/// The texts of a BERT model's reference through its graphs: (GPU outputs,
/// reference embeddings), both in file order.
fn texts_through(
    c: &mut Ctx<'_>,
    Subject { mc, model, gw, .. }: Subject<'_>,
    graphs: &mut [(Bucket, CapturedGraph)],
    items: Vec<RefItem>,
    res: &mut ReferenceResult,
) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    let dim = model.info.output_dim;
    let mut texts: Vec<(Vec<u32>, Vec<f32>)> = Vec::new();
    for it in items {
        if let RefItem::Tokens(ids, emb) = it {
            if emb.len() != dim {
                bail!("embedding of {} values for a model of {dim}", emb.len());
            }
            texts.push((ids, emb));
        }
    }
    let lens: Vec<usize> = texts.iter().map(|t| t.0.len()).collect();
    let packed = mc.batching_mode() == BatchingMode::Packed;
    let batches: Vec<(Vec<usize>, Option<usize>)> = if packed {
        let max_len_of = |b: Bucket| model.program_for(b).map_or(0, |p| p.seq);
        let shapes: Vec<(Bucket, usize)> =
            graphs.iter().map(|(b, _)| (*b, max_len_of(*b))).collect();
        packed_batches(&lens, &shapes)
            .into_iter()
            .map(|(range, graph)| (range.collect(), graph))
            .collect()
    } else {
        let shapes: Vec<(usize, usize)> = graphs.iter().map(|(b, _)| padded_shape(*b)).collect();
        padded_batches(&lens, &shapes)
    };
    let mut out = vec![0f32; texts.len() * dim];
    for (batch, graph) in batches {
        let rows = BatchRows::Tokens(batch.iter().map(|&k| texts[k].0.clone()).collect());
        let values = match graph {
            Some(g) => {
                let graph = &mut graphs[g].1;
                c.gpu.launch(graph, &rows).and_then(|p| c.gpu.collect(p))
            }
            None => {
                res.eager_items += batch.len();
                let program = if packed {
                    model.eager_program(&rows, true)
                } else {
                    let longest = batch.iter().map(|&k| lens[k]).max().unwrap_or(1);
                    model.program(batch.len(), longest)
                };
                c.gpu.run_eager(model, gw, &program, &rows)
            }
        }
        .map_err(|e| anyhow!("{e}"))?;
        if values.len() != batch.len() * dim {
            bail!(
                "{} output values for {} texts of {dim}",
                values.len(),
                batch.len()
            );
        }
        for (r, &k) in batch.iter().enumerate() {
            out[k * dim..(k + 1) * dim].copy_from_slice(&values[r * dim..(r + 1) * dim]);
        }
    }
    res.items = texts.len();
    Ok((out, texts.into_iter().flat_map(|t| t.1).collect()))
}

/// The batches of an MLP's reference, each through the smallest graph that
/// holds it (else the eager path): (GPU outputs, reference outputs).
fn batches_through(
    c: &mut Ctx<'_>,
    Subject { model, gw, .. }: Subject<'_>,
    graphs: &mut [(Bucket, CapturedGraph)],
    items: Vec<RefItem>,
    res: &mut ReferenceResult,
) -> anyhow::Result<(Vec<f32>, Vec<f32>)> {
    let shapes: Vec<(usize, usize)> = graphs.iter().map(|(b, _)| padded_shape(*b)).collect();
    let (mut gpu_all, mut ref_all) = (Vec::new(), Vec::new());
    for it in items {
        if let RefItem::Batch(inp, outp) = it {
            let n = inp.len();
            let features = inp.first().map(Vec::len).unwrap_or(0);
            let rows = BatchRows::Features {
                features,
                data: inp.concat(),
            };
            let values = match smallest_padded(&shapes, n, 1) {
                Some(g) => {
                    let graph = &mut graphs[g].1;
                    c.gpu.launch(graph, &rows).and_then(|p| c.gpu.collect(p))
                }
                None => {
                    res.eager_items += n;
                    c.gpu.run_eager(model, gw, &model.program(n, 1), &rows)
                }
            }
            .map_err(|e| anyhow!("{e}"))?;
            gpu_all.extend_from_slice(&values);
            ref_all.extend(outp.concat());
            res.items += n;
        }
    }
    Ok((gpu_all, ref_all))
}

/// Groups texts of lengths `lens` into batches for padded graphs of the
/// given (batch, seq) `shapes`: by the seq bucket a text falls into (file
/// order within one), at most the largest batch at a time; each batch runs
/// in the smallest graph that holds it (`Some(index into shapes)`), or on
/// the eager path (`None`: texts longer than every seq bucket).
fn padded_batches(lens: &[usize], shapes: &[(usize, usize)]) -> Vec<(Vec<usize>, Option<usize>)> {
    let max_batch = shapes.iter().map(|(b, _)| *b).max().unwrap_or(1);
    let bucket_of = |len: usize| shapes.iter().map(|(_, s)| *s).filter(|s| *s >= len).min();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| bucket_of(lens[i]).unwrap_or(usize::MAX));
    let mut out = Vec::new();
    let mut i = 0;
    while i < order.len() {
        let bucket = bucket_of(lens[order[i]]);
        let mut j = i;
        while j < order.len() && j - i < max_batch && bucket_of(lens[order[j]]) == bucket {
            j += 1;
        }
        let batch = order[i..j].to_vec();
        let longest = batch.iter().map(|&k| lens[k]).max().unwrap_or(1);
        let graph = smallest_padded(shapes, batch.len(), longest);
        out.push((batch, graph));
        i = j;
    }
    out
}

/// Groups sequences of lengths `lens`, in order, into batches for packed
/// graphs of the given (bucket, longest sequence) shapes, as a packed
/// batcher does: each batch takes as many of the next sequences as the
/// largest graph holds, and runs in the smallest graph that holds it
/// (`Some(index into shapes)`); a sequence no graph holds runs alone on the
/// eager path (`None`).
fn packed_batches(
    lens: &[usize],
    shapes: &[(Bucket, usize)],
) -> Vec<(Range<usize>, Option<usize>)> {
    let pick = |tokens: usize, n: usize, longest: usize| {
        shapes
            .iter()
            .enumerate()
            .filter(|(_, (b, ml))| b.tokens() >= tokens && b.rows() >= n && *ml >= longest)
            .min_by_key(|(_, (b, _))| b.tokens())
            .map(|(i, _)| i)
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < lens.len() {
        let (mut j, mut tokens, mut longest) = (i, 0, 0);
        while j < lens.len() && pick(tokens + lens[j], j + 1 - i, longest.max(lens[j])).is_some() {
            tokens += lens[j];
            longest = longest.max(lens[j]);
            j += 1;
        }
        if j == i {
            out.push((i..i + 1, None));
            i += 1;
        } else {
            out.push((i..j, pick(tokens, j - i, longest)));
            i = j;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_texts_are_batched_into_the_smallest_holding_graph() {
        let shapes = [(Bucket::packed(256, 4), 256), (Bucket::packed(64, 64), 64)];
        let lens = [10, 20, 30, 300, 5, 100, 100, 60, 1, 1, 1, 1, 1];
        let b = packed_batches(&lens, &shapes);
        assert_eq!(
            b,
            vec![
                (0..3, Some(1)),   // 60 tokens: the 64-token graph
                (3..4, None),      // longer than any graph allows: eager
                (4..7, Some(0)),   // 205 tokens; with the 60 it would be 265
                (7..12, Some(1)),  // 64 tokens exactly
                (12..13, Some(1)), // the rest
            ]
        );
        // Every text in exactly one batch, in order; every graph batch fits.
        let mut next = 0;
        for (r, g) in &b {
            assert_eq!(r.start, next);
            next = r.end;
            if let Some(g) = g {
                let (bucket, max_len) = shapes[*g];
                let l = &lens[r.clone()];
                assert!(l.iter().sum::<usize>() <= bucket.tokens() && l.len() <= bucket.rows());
                assert!(l.iter().all(|&x| x <= max_len));
            }
        }
        assert_eq!(next, lens.len());
        assert!(packed_batches(&[], &shapes).is_empty());
    }

    #[test]
    fn padded_reference_texts_are_grouped_by_seq_bucket() {
        // Graphs as captured, largest first: (8, 128), (8, 16), (1, 128), (1, 16).
        let shapes = [(8, 128), (8, 16), (1, 128), (1, 16)];
        let lens = [100, 5, 200, 16, 17, 3];
        let b = padded_batches(&lens, &shapes);
        assert_eq!(
            b,
            vec![
                (vec![1, 3, 5], Some(1)), // the 16-token bucket, file order
                (vec![0, 4], Some(0)),    // the 128-token bucket
                (vec![2], None),          // longer than every bucket: eager
            ]
        );
        // No more than the largest batch at a time; one text alone fits the
        // smallest graph.
        let b = padded_batches(&[4; 10], &shapes);
        assert_eq!(b.len(), 2);
        assert_eq!((b[0].0.len(), b[0].1), (8, Some(1)));
        assert_eq!((b[1].0.len(), b[1].1), (2, Some(1)));
        assert_eq!(padded_batches(&[4], &shapes), vec![(vec![0], Some(3))]);
        // No graph at all: each text alone, eager.
        assert_eq!(
            padded_batches(&[4, 4], &[]),
            vec![(vec![0], None), (vec![1], None)]
        );
        assert!(padded_batches(&[], &shapes).is_empty());
    }
}
