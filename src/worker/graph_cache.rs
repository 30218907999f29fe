//! The graph cache: one captured graph per (model, bucket), owned by the
//! worker's backend thread.
//!
//! A model's buckets are padded (batch, seq) rectangles or packed token
//! budgets ([`Grid`]); a packed bucket's graph holds up to `seqs` sequences
//! end to end in `tokens` slots and returns one row per sequence.
//! Graphs are captured at start-up, largest bucket first (so the first
//! capture sizes any memory pool the backend shares between graphs), and
//! looked up by exact bucket: a batch never runs on a graph of another shape.
//! Every program is validated ([`crate::model::Program::validate`]) before
//! a backend captures it, and each graph keeps what validation learned, so
//! the executor checks every batch against it before a replay.
//! A new worker process starts with an empty cache and re-captures
//! everything. A reload captures a model's new grid beside its old one
//! ([`GraphCache::capture_buckets`] skips buckets it has) and, once the
//! daemon has switched, [`GraphCache::release`] drops the old buckets.

use super::link::GraphReport;
use crate::backend::{Backend, BackendError};
use crate::bucket::{Bucket, Grid};
use crate::model::{Model, ProgramFacts};
use std::collections::HashMap;
use std::time::Instant;

pub struct CachedGraph<G> {
    pub graph: G,
    /// What the graph's program accepts (see [`ProgramFacts::check_rows`]).
    pub facts: ProgramFacts,
    pub capture_us: u64,
    pub memory_bytes: u64,
    pub replays: u64,
}

pub struct GraphCache<B: Backend> {
    graphs: HashMap<(usize, Bucket), CachedGraph<B::Graph>>,
}

impl<B: Backend> Default for GraphCache<B> {
    fn default() -> Self {
        Self {
            graphs: HashMap::new(),
        }
    }
}

impl<B: Backend> GraphCache<B> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Captures every bucket of `grid` (padded or packed) for model
    /// `index`, largest first.
    pub fn capture_model(
        &mut self,
        backend: &mut B,
        index: usize,
        model: &Model,
        weights: &B::Weights,
        grid: &Grid,
    ) -> Result<Vec<GraphReport>, BackendError> {
        self.capture_buckets(
            backend,
            index,
            model,
            weights,
            &grid.largest_first(),
            |_| {},
        )
    }

    /// Captures these buckets of model `index` (in this order) that have no
    /// graph yet, calling `each` after every capture; graphs it has are kept
    /// as they are. A reload captures a new grid this way, beside the old.
    /// On an error, what was captured before it stays in the cache.
    pub fn capture_buckets(
        &mut self,
        backend: &mut B,
        index: usize,
        model: &Model,
        weights: &B::Weights,
        buckets: &[Bucket],
        mut each: impl FnMut(&GraphReport),
    ) -> Result<Vec<GraphReport>, BackendError> {
        let mut reports = Vec::new();
        for &bucket in buckets {
            if self.graphs.contains_key(&(index, bucket)) {
                continue;
            }
            let program = model
                .program_for(bucket)
                .map_err(|e| BackendError::Unsupported(e.to_string()))?;
            let facts = program
                .validate(&model.weights)
                .map_err(|e| BackendError::Other(e.to_string()))?;
            let started = Instant::now();
            let graph = backend.capture(model, weights, &program)?;
            let capture_us = started.elapsed().as_micros() as u64;
            let memory_bytes = backend.graph_memory_bytes(&graph);
            tracing::debug!(model = %model.info.name, %bucket, capture_us, memory_bytes, "captured");
            let report = GraphReport {
                model: index,
                bucket,
                capture_us,
                memory_bytes,
            };
            each(&report);
            reports.push(report);
            self.graphs.insert(
                (index, bucket),
                CachedGraph {
                    graph,
                    facts,
                    capture_us,
                    memory_bytes,
                    replays: 0,
                },
            );
        }
        Ok(reports)
    }

    pub fn get_mut(&mut self, model: usize, bucket: Bucket) -> Option<&mut CachedGraph<B::Graph>> {
        self.graphs.get_mut(&(model, bucket))
    }

    /// Drops every graph of `model`.
    pub fn invalidate(&mut self, model: usize) {
        self.graphs.retain(|(m, _), _| *m != model);
    }

    /// Drops the graphs of `model` whose bucket `keep` rejects; returns their buckets.
    pub fn release(&mut self, model: usize, keep: impl Fn(Bucket) -> bool) -> Vec<Bucket> {
        let mut dropped: Vec<Bucket> = self
            .graphs
            .keys()
            .filter(|(m, b)| *m == model && !keep(*b))
            .map(|(_, b)| *b)
            .collect();
        dropped.sort();
        for b in &dropped {
            self.graphs.remove(&(model, *b));
        }
        dropped
    }

    pub fn contains(&self, model: usize, bucket: Bucket) -> bool {
        self.graphs.contains_key(&(model, bucket))
    }

    pub fn len(&self) -> usize {
        self.graphs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.graphs.is_empty()
    }
}
