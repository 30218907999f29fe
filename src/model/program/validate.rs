//! The rules of the op IR, checked once before any backend sees a program,
//! and the check of a batch against a validated program.
//!
//! [`Program::validate`] is called by the worker's graph cache before every
//! capture and by the executor before every eager run; a backend may then
//! assume everything below and only translate ops, so the CPU and CUDA
//! backends cannot disagree about what a program means. Rules:
//!
//! * The program's `batch` and `seq`, and every op dimension, are positive.
//! * Every buffer and weight an op names exists; every buffer is at least as
//!   large as the op's shape needs; integer operands (ids, token types,
//!   masks) are integer inputs and float operands are not.
//! * Ops write only activations or the output, never an input.
//! * No op reads the buffer it writes, except `AddLayerNorm`, whose `out`
//!   may alias `residual` (never `x`).
//! * Every activation is written before it is read (activations live in an
//!   arena another program may have left anything in).
//! * Weight shapes match: a linear layer's `[n, k]` and `[n]`, a LayerNorm's
//!   `[hidden]`, embedding tables `[rows, hidden]` with at least one row and a
//!   position table of the rows its [`PositionIds`](super::PositionIds) need
//!   for `seq` tokens (`seq`, or `pad + 1 + seq`), an attention bias table
//!   `[heads, 2·radius + 1]`.
//! * Token ops (embedding, attention, pooling) carry the program's
//!   [`Seqs`]: of its layout, with its `batch` and `seq` (padded) or its
//!   `tokens`, `batch` and `seq` as `tokens`, `seqs` and `max_seq_len`
//!   (packed), and every integer operand in the role the op reads it as:
//!   ids `TokenIds`, types `TokenTypeIds`, the mask `AttentionMask`,
//!   offsets `SeqOffsets`, positions `Positions` (the kernels trust their
//!   structure, which only the packing of a batch guarantees).
//! * `Normalize` rewrites its buffer in place (an activation or the output
//!   already written); a pooling's `skip` is the `PoolSkip` input of one
//!   count per sequence.
//! * Inputs: each listed input is an `Input` buffer and every `Input`
//!   buffer is listed; a feature input holds whole rows of the batch; a
//!   token input holds exactly `batch · seq` elements. A program has either
//!   one feature input, or token inputs whose ids an embedding reads.
//! * There is exactly one `Output` buffer, the program's output, of exactly
//!   `batch · output_dim` elements.
//!
//! Packed programs ([`Layout::Packed`]) follow these rules too, and:
//!
//! * `tokens ≥ 1` and the longest sequence fits the budget (`seq ≤ tokens`).
//! * Inputs: `TokenIds`, `TokenTypeIds` and `Positions` hold exactly `tokens`
//!   elements and `SeqOffsets` exactly `batch + 1`; a packed program has no
//!   feature input and no attention mask, and a padded one neither positions
//!   nor offsets.
//!
//! [`ProgramFacts::check_rows`] then checks a batch: at least one and at most
//! `batch` rows, sequences of at most `seq` tokens with ids inside the
//! vocabulary, feature rows of the input's width; for a packed program also
//! at most `tokens` tokens in all.

use super::{BufId, BufKind, InputRole, Layout, Op, Program, Seqs, WeightId};
use crate::model::batch::{token_id, token_type};
use crate::model::weights::WeightTensor;
use crate::model::{BatchRows, Weights};
use thiserror::Error;

/// A program that breaks one of the IR's rules (a bug in the model builder,
/// or a shape the model cannot run, e.g. longer than its position table).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("invalid program: {0}")]
pub struct ProgramError(pub String);

/// A batch that does not fit the program it was sent to.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{0}")]
pub struct BatchError(pub String);

/// What a program's inputs accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgramInput {
    /// f32 rows of this width.
    Features { width: usize },
    /// Token ids below this vocabulary size (the word embedding's rows),
    /// of token types below `types` (the token-type table's rows: a token
    /// with [`SEGMENT_BIT`](crate::model::batch::SEGMENT_BIT), type 1,
    /// needs 2).
    Tokens { vocab: usize, types: usize },
}

/// What validation learned about a program: enough to check batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramFacts {
    /// Most rows (padded) or sequences (packed).
    pub batch: usize,
    /// Longest sequence.
    pub seq: usize,
    /// Packed programs: the token budget (the most tokens of a batch, all
    /// sequences together).
    pub tokens: Option<usize>,
    pub input: ProgramInput,
}

fn invalid<T>(message: impl Into<String>) -> Result<T, ProgramError> {
    Err(ProgramError(message.into()))
}

/// Checks references of one op against the program's declarations.
struct Checker<'a> {
    program: &'a Program,
    weights: &'a Weights,
    what: String,
}

impl<'a> Checker<'a> {
    fn positive(&self, dims: &[usize]) -> Result<(), ProgramError> {
        if dims.contains(&0) {
            return invalid(format!("{} has a zero dimension {dims:?}", self.what));
        }
        Ok(())
    }

    /// A buffer the op reads or writes: exists, is large enough, and holds
    /// integers exactly when `integer`.
    fn buf(&self, id: BufId, need: usize, integer: bool) -> Result<(), ProgramError> {
        let what = &self.what;
        let Some(decl) = self.program.buffers.get(id.0) else {
            return invalid(format!(
                "{what} refers to buffer {} which is not declared",
                id.0
            ));
        };
        let is_integer = matches!(decl.kind, BufKind::Input(role) if role.is_integer());
        if is_integer != integer {
            return invalid(format!(
                "{what} needs an {} buffer, `{}` is {:?}",
                if integer { "i32" } else { "f32" },
                decl.name,
                decl.kind
            ));
        }
        if decl.elems < need {
            return invalid(format!(
                "{what} needs {need} elements, `{}` has {}",
                decl.name, decl.elems
            ));
        }
        Ok(())
    }

    /// A float buffer the op writes (an activation or the output).
    fn out(&self, id: BufId, need: usize) -> Result<(), ProgramError> {
        self.buf(id, need, false)?;
        if matches!(self.program.buffers[id.0].kind, BufKind::Input(_)) {
            return invalid(format!("{} writes an input buffer", self.what));
        }
        Ok(())
    }

    /// An integer input the op reads as `role` (packed ops: the kernels
    /// trust the structure only the packing of that role guarantees).
    fn role(&self, id: BufId, role: InputRole, need: usize) -> Result<(), ProgramError> {
        self.buf(id, need, true)?;
        let decl = &self.program.buffers[id.0];
        if decl.kind != BufKind::Input(role) {
            return invalid(format!(
                "{} reads `{}` ({:?}) as {role:?}",
                self.what, decl.name, decl.kind
            ));
        }
        Ok(())
    }

    /// A token op's [`Seqs`]: the program's layout and sizes, and the
    /// inputs that describe its sequences in the roles the kernels trust
    /// (their structure only the packing of a batch guarantees).
    fn seqs(&self, seqs: Seqs) -> Result<(), ProgramError> {
        let p = self.program;
        match (seqs, p.layout) {
            (Seqs::Padded { mask, batch, seq }, Layout::Padded) => {
                self.positive(&[batch, seq])?;
                self.same("batch", batch, p.batch)?;
                self.same("seq", seq, p.seq)?;
                self.role(mask, InputRole::AttentionMask, batch * seq)
            }
            (
                Seqs::Packed {
                    offsets,
                    positions,
                    tokens,
                    seqs,
                    max_seq_len,
                },
                Layout::Packed { .. },
            ) => {
                self.positive(&[tokens, seqs, max_seq_len])?;
                self.same("tokens", tokens, p.token_slots())?;
                self.same("seqs", seqs, p.batch)?;
                self.same("max_seq_len", max_seq_len, p.seq)?;
                self.role(offsets, InputRole::SeqOffsets, seqs + 1)?;
                self.role(positions, InputRole::Positions, tokens)
            }
            (seqs, _) => invalid(format!(
                "{} is a {} op in a {} program",
                self.what,
                if seqs.is_packed() { "packed" } else { "padded" },
                if seqs.is_packed() { "padded" } else { "packed" }
            )),
        }
    }

    /// A token op's dimension that must equal the program's.
    fn same(&self, name: &str, op: usize, program: usize) -> Result<(), ProgramError> {
        if op != program {
            return invalid(format!(
                "{} has {name} {op}, the program {program}",
                self.what
            ));
        }
        Ok(())
    }

    fn distinct(&self, read: BufId, write: BufId, names: &str) -> Result<(), ProgramError> {
        if read == write {
            return invalid(format!("{}: {names}", self.what));
        }
        Ok(())
    }

    /// The weight `id` names, if it exists.
    fn existing(&self, id: WeightId) -> Result<&'a WeightTensor, ProgramError> {
        if id.0 >= self.weights.len() {
            return invalid(format!(
                "{} refers to weight {} which does not exist",
                self.what, id.0
            ));
        }
        Ok(self.weights.get(id))
    }

    fn weight(&self, id: WeightId, shape: &[usize]) -> Result<(), ProgramError> {
        let what = &self.what;
        let t = self.existing(id)?;
        if t.shape != shape {
            return invalid(format!(
                "{what}: weight `{}` has shape {:?}, the op needs {shape:?}",
                t.name, t.shape
            ));
        }
        Ok(())
    }

    /// Grouped-query attention: the query heads split evenly over the
    /// key/value heads.
    fn kv_heads(&self, heads: usize, kv_heads: usize) -> Result<(), ProgramError> {
        if !heads.is_multiple_of(kv_heads) {
            return invalid(format!(
                "{}: {heads} query heads do not split over {kv_heads} key/value heads",
                self.what
            ));
        }
        Ok(())
    }

    fn norm_eps(&self, eps: f32) -> Result<(), ProgramError> {
        if !(eps.is_finite() && eps >= 0.0) {
            return invalid(format!("{}: norm eps {eps} is not ≥ 0", self.what));
        }
        Ok(())
    }

    /// An embedding table `[rows ≥ min_rows, width]`; returns its rows.
    fn table(&self, id: WeightId, min_rows: usize, width: usize) -> Result<usize, ProgramError> {
        let what = &self.what;
        let t = self.existing(id)?;
        match t.shape.as_slice() {
            [rows, cols] if *cols == width && *rows >= min_rows.max(1) => Ok(*rows),
            shape => invalid(format!(
                "{what}: weight `{}` has shape {shape:?}, the op needs [≥{}, {width}]",
                t.name,
                min_rows.max(1)
            )),
        }
    }
}

/// The buffers an op reads, and the one it writes.
pub fn op_buffers(op: &Op) -> (Vec<BufId>, BufId) {
    match op {
        Op::EmbedLayerNorm(e) => {
            let positions = match e.seqs {
                Seqs::Packed { positions, .. } => Some(positions),
                Seqs::Padded { .. } => None,
            };
            let reads = [e.ids, e.token_types].into_iter().chain(positions);
            (reads.collect(), e.out)
        }
        Op::Linear(l) => (vec![l.x], l.out),
        Op::AddLayerNorm(a) => (vec![a.x, a.residual], a.out),
        Op::Attention(a) => (vec![a.qkv, a.seqs.index()], a.out),
        Op::Pool(p) => {
            let reads = [p.x, p.seqs.index()].into_iter().chain(p.skip);
            (reads.collect(), p.out)
        }
        Op::Normalize(n) => (vec![n.x], n.x),
        Op::Embed(e) => (vec![e.ids], e.out),
        Op::LayerNorm(l) => (vec![l.x], l.out),
        Op::Add(a) => (vec![a.x, a.into], a.into),
        Op::Rotary(r) => {
            let positions = match r.seqs {
                Seqs::Packed { positions, .. } => positions,
                Seqs::Padded { mask, .. } => mask,
            };
            (vec![r.qkv, positions], r.qkv)
        }
        Op::Gated(g) => (vec![g.x], g.out),
        Op::RmsNorm(n) => (vec![n.x], n.out),
        Op::HeadRmsNorm(n) => (vec![n.qkv], n.qkv),
    }
}

impl Program {
    /// Checks every rule in the module docs against `weights` (the model's
    /// weight table, whose shapes the ops must match).
    pub fn validate(&self, weights: &Weights) -> Result<ProgramFacts, ProgramError> {
        let (batch, seq) = (self.batch, self.seq);
        if batch == 0 || seq == 0 {
            return invalid(format!("the program has a zero dimension [{batch}, {seq}]"));
        }
        let tokens = match self.layout {
            Layout::Padded => None,
            Layout::Packed { tokens } => {
                if tokens == 0 {
                    return invalid("the packed program has a budget of 0 tokens");
                }
                if seq > tokens {
                    return invalid(format!(
                        "the packed program's longest sequence ({seq}) exceeds its budget of {tokens} tokens"
                    ));
                }
                Some(tokens)
            }
        };
        let mut vocab = None;
        let mut types = 1;
        let mut written = vec![false; self.buffers.len()];
        for (i, op) in self.ops.iter().enumerate() {
            let c = Checker {
                program: self,
                weights,
                what: format!("op {i} ({})", op_name(op)),
            };
            self.validate_op(&c, op, &mut vocab, &mut types)?;
            let (reads, out) = op_buffers(op);
            for id in reads {
                let decl = &self.buffers[id.0];
                if decl.kind == BufKind::Activation && !written[id.0] {
                    return invalid(format!(
                        "op {i} reads activation `{}` before any op writes it",
                        decl.name
                    ));
                }
            }
            written[out.0] = true;
        }
        let input = self.validate_inputs(vocab.map(|v| (v, types)))?;
        self.validate_output()?;
        Ok(ProgramFacts {
            batch,
            seq,
            tokens,
            input,
        })
    }

    fn validate_op(
        &self,
        c: &Checker<'_>,
        op: &Op,
        vocab: &mut Option<usize>,
        types: &mut usize,
    ) -> Result<(), ProgramError> {
        match op {
            Op::EmbedLayerNorm(e) => {
                let (seqs, hidden) = (e.seqs, e.hidden);
                c.seqs(seqs)?;
                c.positive(&[hidden])?;
                let rows = seqs.token_rows();
                c.role(e.ids, InputRole::TokenIds, rows)?;
                c.role(e.token_types, InputRole::TokenTypeIds, rows)?;
                *vocab = Some(c.table(e.word, 1, hidden)?);
                let positions = e.position_ids.rows_needed(seqs.max_len());
                c.table(e.position, positions, hidden)?;
                *types = c.table(e.token_type, 1, hidden)?;
                c.weight(e.gamma, &[hidden])?;
                c.weight(e.beta, &[hidden])?;
                c.out(e.out, rows * hidden)
            }
            Op::Linear(l) => {
                c.positive(&[l.m, l.n, l.k])?;
                c.weight(l.w, &[l.n, l.k])?;
                if let Some(b) = l.bias {
                    c.weight(b, &[l.n])?;
                }
                c.buf(l.x, l.m * l.k, false)?;
                c.out(l.out, l.m * l.n)?;
                c.distinct(l.x, l.out, "reads and writes the same buffer")
            }
            Op::AddLayerNorm(a) => {
                let elems = a.rows * a.hidden;
                c.positive(&[a.rows, a.hidden])?;
                c.distinct(a.x, a.out, "out aliases x")?;
                c.buf(a.x, elems, false)?;
                c.buf(a.residual, elems, false)?;
                c.weight(a.gamma, &[a.hidden])?;
                c.weight(a.beta, &[a.hidden])?;
                c.out(a.out, elems)
            }
            Op::Attention(a) => {
                c.seqs(a.seqs)?;
                c.positive(&[a.heads, a.kv_heads, a.head_dim])?;
                c.kv_heads(a.heads, a.kv_heads)?;
                c.distinct(a.qkv, a.out, "out aliases qkv")?;
                if let Some(b) = a.bias {
                    c.weight(b.table, &[a.heads, 2 * b.radius + 1])?;
                }
                if let Some(s) = a.scale.filter(|s| !(s.is_finite() && *s > 0.0)) {
                    return invalid(format!("{}: score scale {s} is not > 0", c.what));
                }
                let rows = a.seqs.token_rows();
                c.buf(a.qkv, rows * a.qkv_width(), false)?;
                c.out(a.out, rows * a.heads * a.head_dim)
            }
            Op::Pool(p) => {
                c.seqs(p.seqs)?;
                c.positive(&[p.hidden])?;
                c.distinct(p.x, p.out, "out aliases x")?;
                if let Some(skip) = p.skip {
                    c.role(skip, InputRole::PoolSkip, p.seqs.count())?;
                }
                c.buf(p.x, p.seqs.token_rows() * p.hidden, false)?;
                c.out(p.out, p.seqs.count() * p.hidden)
            }
            Op::Normalize(n) => {
                c.positive(&[n.rows, n.width])?;
                c.out(n.x, n.rows * n.width)
            }
            Op::Embed(e) => {
                c.seqs(e.seqs)?;
                c.positive(&[e.hidden])?;
                if !(e.scale.is_finite() && e.scale > 0.0) {
                    return invalid(format!(
                        "{}: embedding scale {} is not > 0",
                        c.what, e.scale
                    ));
                }
                let rows = e.seqs.token_rows();
                c.role(e.ids, InputRole::TokenIds, rows)?;
                *vocab = Some(c.table(e.word, 1, e.hidden)?);
                c.out(e.out, rows * e.hidden)
            }
            Op::LayerNorm(l) => {
                let elems = l.rows * l.hidden;
                c.positive(&[l.rows, l.hidden])?;
                c.buf(l.x, elems, false)?;
                c.weight(l.gamma, &[l.hidden])?;
                if let Some(b) = l.beta {
                    c.weight(b, &[l.hidden])?;
                }
                c.out(l.out, elems)
            }
            Op::Add(a) => {
                let elems = a.rows * a.width;
                c.positive(&[a.rows, a.width])?;
                c.distinct(a.x, a.into, "adds a buffer to itself")?;
                c.buf(a.x, elems, false)?;
                c.out(a.into, elems)
            }
            Op::Rotary(r) => {
                c.seqs(r.seqs)?;
                c.positive(&[r.heads, r.head_dim])?;
                if r.head_dim % 2 != 0 {
                    return invalid(format!("{}: rotary head_dim {} is odd", c.what, r.head_dim));
                }
                if !(r.theta.is_finite() && r.theta > 1.0) {
                    return invalid(format!("{}: rotary theta {} is not > 1", c.what, r.theta));
                }
                if !(r.scale.is_finite() && r.scale > 0.0) {
                    return invalid(format!("{}: rotary scale {} is not > 0", c.what, r.scale));
                }
                c.kv_heads(r.heads, r.kv_heads)?;
                c.out(
                    r.qkv,
                    r.seqs.token_rows() * (r.heads + 2 * r.kv_heads) * r.head_dim,
                )
            }
            Op::Gated(g) => {
                c.positive(&[g.rows, g.width])?;
                c.distinct(g.x, g.out, "out aliases x")?;
                c.buf(g.x, 2 * g.rows * g.width, false)?;
                c.out(g.out, g.rows * g.width)
            }
            Op::RmsNorm(n) => {
                let elems = n.rows * n.hidden;
                c.positive(&[n.rows, n.hidden])?;
                c.norm_eps(n.eps)?;
                c.buf(n.x, elems, false)?;
                c.weight(n.gamma, &[n.hidden])?;
                c.out(n.out, elems)
            }
            Op::HeadRmsNorm(n) => {
                c.positive(&[n.rows, n.heads, n.kv_heads, n.head_dim])?;
                c.kv_heads(n.heads, n.kv_heads)?;
                c.norm_eps(n.eps)?;
                c.weight(n.q_gamma, &[n.head_dim])?;
                c.weight(n.k_gamma, &[n.head_dim])?;
                c.out(n.qkv, n.rows * (n.heads + 2 * n.kv_heads) * n.head_dim)
            }
        }
    }

    fn validate_inputs(&self, vocab: Option<(usize, usize)>) -> Result<ProgramInput, ProgramError> {
        let (batch, seq) = (self.batch, self.seq);
        let mut features = None;
        let mut has_ids = false;
        for &id in &self.inputs {
            let Some(decl) = self.buffers.get(id.0) else {
                return invalid(format!("input buffer {} is not declared", id.0));
            };
            let BufKind::Input(role) = decl.kind else {
                return invalid(format!(
                    "`{}` is listed as an input but is {:?}",
                    decl.name, decl.kind
                ));
            };
            if role == InputRole::PoolSkip {
                if decl.elems != batch {
                    return invalid(format!(
                        "input `{}` ({role:?}) has {} elements, expected batch = {batch}",
                        decl.name, decl.elems
                    ));
                }
            } else if let Layout::Packed { tokens } = self.layout {
                let want = match role {
                    InputRole::TokenIds | InputRole::TokenTypeIds | InputRole::Positions => tokens,
                    InputRole::SeqOffsets => batch + 1,
                    InputRole::PoolSkip => unreachable!("checked above"),
                    InputRole::Features | InputRole::AttentionMask => {
                        return invalid(format!(
                            "input `{}` ({role:?}) in a packed program",
                            decl.name
                        ))
                    }
                };
                if decl.elems != want {
                    return invalid(format!(
                        "packed input `{}` ({role:?}) has {} elements, expected {want}",
                        decl.name, decl.elems
                    ));
                }
            } else if matches!(role, InputRole::Positions | InputRole::SeqOffsets) {
                return invalid(format!(
                    "input `{}` ({role:?}) in a padded program",
                    decl.name
                ));
            } else if role == InputRole::Features {
                if decl.elems == 0 || decl.elems % batch != 0 {
                    return invalid(format!(
                        "feature input `{}` has {} elements, not a multiple of batch {batch}",
                        decl.name, decl.elems
                    ));
                }
                if features.is_some() {
                    return invalid("a second feature input");
                }
                features = Some(decl.elems / batch);
            } else if decl.elems != batch * seq {
                return invalid(format!(
                    "token input `{}` has {} elements, expected batch·seq = {}",
                    decl.name,
                    decl.elems,
                    batch * seq
                ));
            }
            has_ids |= role == InputRole::TokenIds;
        }
        for (i, decl) in self.buffers.iter().enumerate() {
            if matches!(decl.kind, BufKind::Input(_)) && !self.inputs.contains(&BufId(i)) {
                return invalid(format!(
                    "input buffer `{}` is not in the input list",
                    decl.name
                ));
            }
        }
        match (features, vocab) {
            (Some(width), None) if !has_ids => Ok(ProgramInput::Features { width }),
            (None, Some((vocab, types))) if has_ids => Ok(ProgramInput::Tokens { vocab, types }),
            _ => invalid("expected either one feature input, or token inputs read by an embedding"),
        }
    }

    fn validate_output(&self) -> Result<(), ProgramError> {
        let Some(out) = self.buffers.get(self.output.0) else {
            return invalid("the output buffer is not declared");
        };
        let need = self.batch * self.output_dim;
        if out.kind != BufKind::Output || out.elems != need || self.output_dim == 0 {
            return invalid(format!(
                "output `{}` must be an Output buffer of batch·output_dim = {need} elements (it is {:?} of {})",
                out.name, out.kind, out.elems
            ));
        }
        if let Some((_, second)) = self
            .buffers
            .iter()
            .enumerate()
            .find(|(i, d)| d.kind == BufKind::Output && *i != self.output.0)
        {
            return invalid(format!("second output buffer `{}`", second.name));
        }
        Ok(())
    }
}

fn op_name(op: &Op) -> &'static str {
    match op {
        Op::EmbedLayerNorm(_) => "EmbedLayerNorm",
        Op::Linear(_) => "Linear",
        Op::AddLayerNorm(_) => "AddLayerNorm",
        Op::Attention(_) => "Attention",
        Op::Pool(_) => "Pool",
        Op::Normalize(_) => "Normalize",
        Op::Embed(_) => "Embed",
        Op::LayerNorm(_) => "LayerNorm",
        Op::Add(_) => "Add",
        Op::Rotary(_) => "Rotary",
        Op::Gated(_) => "Gated",
        Op::RmsNorm(_) => "RmsNorm",
        Op::HeadRmsNorm(_) => "HeadRmsNorm",
    }
}

impl ProgramFacts {
    /// Checks that `rows` fit the program; packing and every backend rely on it.
    pub fn check_rows(&self, rows: &BatchRows) -> Result<(), BatchError> {
        let bad = |m: String| Err(BatchError(m));
        let n = rows.rows();
        if n == 0 {
            return bad("the batch has no rows".into());
        }
        if n > self.batch {
            return bad(match self.tokens {
                None => format!("{n} rows do not fit the graph's batch of {}", self.batch),
                Some(_) => format!(
                    "{n} sequences do not fit the graph's {} sequences",
                    self.batch
                ),
            });
        }
        match (rows, self.input) {
            (BatchRows::Features { features, data }, ProgramInput::Features { width }) => {
                if *features != width {
                    return bad(format!(
                        "rows have {features} features, the model takes {width}"
                    ));
                }
                if data.len() != n * width {
                    return bad(format!(
                        "{} feature values are not whole rows of {width}",
                        data.len()
                    ));
                }
            }
            (BatchRows::Tokens(seqs), ProgramInput::Tokens { vocab, types }) => {
                if let Some(budget) = self.tokens {
                    let total = rows.tokens();
                    if total > budget {
                        return bad(format!(
                            "{n} sequences of {total} tokens in all do not fit the graph's budget of {budget} tokens"
                        ));
                    }
                }
                for (i, ids) in seqs.iter().enumerate() {
                    if ids.len() > self.seq {
                        return bad(format!(
                            "row {i} has {} tokens, more than the graph's seq of {}",
                            ids.len(),
                            self.seq
                        ));
                    }
                    if let Some(&id) = ids.iter().find(|&&id| token_id(id) as usize >= vocab) {
                        return bad(format!(
                            "row {i} has token id {}, outside the vocabulary of {vocab}",
                            token_id(id)
                        ));
                    }
                    if types < 2 && ids.iter().any(|&id| token_type(id) != 0) {
                        return bad(format!(
                            "row {i} has a second segment (token type 1), the model has {types} token type"
                        ));
                    }
                }
            }
            (BatchRows::Features { .. }, ProgramInput::Tokens { .. }) => {
                return bad("feature rows sent to a token model".into());
            }
            (BatchRows::Tokens(_), ProgramInput::Features { .. }) => {
                return bad("token rows sent to a feature model".into());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::program::{
        one_linear as linear, Activation, AddLayerNorm, Attention, EmbedLayerNorm, Linear, Pool,
        Pooling, ProgramBuilder,
    };

    /// The weights of [`encoder`]: hidden 8, vocab 10, a position table
    /// of 16, two token types.
    fn encoder_weights() -> Weights {
        let (h, vocab) = (8, 10);
        let mut w = Weights::new();
        let z = |n: usize| vec![0.0f32; n];
        w.push("word", vec![vocab, h], z(vocab * h));
        w.push("pos", vec![16, h], z(16 * h));
        w.push("tt", vec![2, h], z(2 * h));
        w.push("g", vec![h], z(h));
        w.push("b", vec![h], z(h));
        w.push("qkv", vec![3 * h, h], z(3 * h * h));
        w
    }

    /// Embedding → qkv → attention → add-norm → pool over the token rows of
    /// `seqs`, 2 heads of 4, with [`encoder_weights`]; returns the output.
    fn encoder_ops(
        b: &mut ProgramBuilder,
        w: &Weights,
        seqs: Seqs,
        ids: BufId,
        types: BufId,
        mode: Pooling,
    ) -> BufId {
        let h = 8;
        let id = |name: &str| {
            WeightId(
                w.iter()
                    .position(|(_, t)| t.name == name)
                    .expect("a weight of encoder_weights()"),
            )
        };
        let rows = seqs.token_rows();
        let hid = b.activation("h", rows * h);
        let qkv = b.activation("qkv", rows * 3 * h);
        let ctx = b.activation("ctx", rows * h);
        let out = b.output("out", seqs.count() * h);
        b.push(EmbedLayerNorm {
            position_ids: Default::default(),
            ids,
            token_types: types,
            word: id("word"),
            position: id("pos"),
            token_type: id("tt"),
            gamma: id("g"),
            beta: id("b"),
            eps: 1e-12,
            out: hid,
            hidden: h,
            seqs,
        });
        b.push(Linear {
            x: hid,
            w: id("qkv"),
            bias: None,
            act: Activation::Identity,
            out: qkv,
            m: rows,
            n: 3 * h,
            k: h,
        });
        b.push(Attention {
            bias: None,
            window: None,
            causal: false,
            scale: None,
            qkv,
            out: ctx,
            heads: 2,
            kv_heads: 2,
            head_dim: 4,
            seqs,
        });
        b.push(AddLayerNorm {
            x: ctx,
            residual: hid,
            gamma: id("g"),
            beta: id("b"),
            eps: 1e-12,
            out: hid,
            rows,
            hidden: h,
        });
        b.push(Pool {
            skip: None,
            x: hid,
            out,
            hidden: h,
            mode,
            normalize: true,
            seqs,
        });
        out
    }

    /// [`encoder_ops`] at `batch` rows of `seq` tokens.
    fn encoder(batch: usize, seq: usize) -> (Program, Weights) {
        let w = encoder_weights();
        let rows = batch * seq;
        let mut b = ProgramBuilder::new();
        let ids = b.input("ids", InputRole::TokenIds, rows);
        let mask = b.input("mask", InputRole::AttentionMask, rows);
        let types = b.input("types", InputRole::TokenTypeIds, rows);
        let seqs = Seqs::Padded { mask, batch, seq };
        let out = encoder_ops(&mut b, &w, seqs, ids, types, Pooling::Mean);
        (b.finish(batch, seq, out, 8), w)
    }

    fn error(p: &Program, w: &Weights) -> String {
        p.validate(w).unwrap_err().to_string()
    }

    /// Random-ish weights for [`encoder`]'s and [`packed_encoder`]'s tables
    /// (the two read the same weight ids), so that their results differ
    /// between tokens, positions and sequences.
    fn filled(w: &Weights) -> Weights {
        let mut out = Weights::new();
        for (i, (_, t)) in w.iter().enumerate() {
            let data = (0..t.data.len())
                .map(|j| (((i * 7919 + j * 104_729) % 1000) as f32 / 500.0 - 1.0) * 0.7)
                .collect();
            out.push(&t.name, t.shape.clone(), data);
        }
        out
    }

    /// [`encoder_ops`] packed (same weights): `tokens` slots, at most
    /// `seqs` sequences of at most `max_len` tokens.
    fn packed_encoder(
        tokens: usize,
        seqs: usize,
        max_len: usize,
        mode: Pooling,
    ) -> (Program, Weights) {
        let w = encoder_weights();
        let mut b = ProgramBuilder::new();
        let ids = b.input("ids", InputRole::TokenIds, tokens);
        let types = b.input("types", InputRole::TokenTypeIds, tokens);
        let positions = b.input("positions", InputRole::Positions, tokens);
        let offsets = b.input("offsets", InputRole::SeqOffsets, seqs + 1);
        let layout = Seqs::Packed {
            offsets,
            positions,
            tokens,
            seqs,
            max_seq_len: max_len,
        };
        let out = encoder_ops(&mut b, &w, layout, ids, types, mode);
        (b.finish_packed(tokens, seqs, max_len, out, 8), w)
    }

    #[test]
    fn packed_programs_give_their_facts() {
        let (p, w) = packed_encoder(32, 5, 16, Pooling::Mean);
        let f = p.validate(&w).unwrap();
        assert_eq!(
            (f.batch, f.seq, f.tokens, f.input),
            (
                5,
                16,
                Some(32),
                ProgramInput::Tokens {
                    vocab: 10,
                    types: 2
                }
            )
        );
        assert_eq!((p.token_slots(), p.is_packed()), (32, true));
        // The padded program has no budget.
        let (p, w) = encoder(2, 8);
        assert_eq!(p.validate(&w).unwrap().tokens, None);
        // A budget of one token holding one sequence.
        let (p, w) = packed_encoder(1, 1, 1, Pooling::Cls);
        p.validate(&w).unwrap();
    }

    #[test]
    fn packed_programs_break_their_own_rules() {
        let check = |p: &Program, w: &Weights, want: &str| {
            let e = error(p, w);
            assert!(e.contains(want), "{want:?} not in {e:?}");
        };
        let (base, w) = packed_encoder(32, 4, 16, Pooling::Mean);
        // The longest sequence must fit the budget and the position table (16 rows).
        let (p, w17) = packed_encoder(32, 4, 17, Pooling::Mean);
        check(&p, &w17, "pos");
        let mut p = base.clone();
        p.seq = 33;
        check(&p, &w, "exceeds its budget");
        let mut p = base.clone();
        p.layout = Layout::Packed { tokens: 0 };
        check(&p, &w, "budget of 0");
        // A padded op in a packed program, and a packed op in a padded one.
        let (padded, pw) = encoder(2, 8);
        let mut p = base.clone();
        p.ops[0] = padded.ops[0].clone();
        check(&p, &w, "padded op in a packed program");
        let mut p = padded.clone();
        p.ops[4] = base.ops[4].clone();
        check(&p, &pw, "packed op in a padded program");
        /// Op `i`'s packed operands: offsets, positions, tokens, seqs, max_seq_len.
        fn packed(
            p: &mut Program,
            i: usize,
        ) -> (&mut BufId, &mut BufId, &mut usize, &mut usize, &mut usize) {
            match p.ops[i].seqs_mut() {
                Some(Seqs::Packed {
                    offsets,
                    positions,
                    tokens,
                    seqs,
                    max_seq_len,
                }) => (offsets, positions, tokens, seqs, max_seq_len),
                other => unreachable!("op {i} is not packed: {other:?}"),
            }
        }
        // One edit of the base each, and the error it must give.
        type Edit<'e> = (&'e str, &'e dyn Fn(&mut Program));
        let edits: [Edit; 9] = [
            // Ops' dimensions are the program's.
            ("seqs 3, the program 4", &|p| *packed(p, 2).3 = 3),
            ("tokens 16, the program 32", &|p| *packed(p, 4).2 = 16),
            ("max_seq_len 8, the program 16", &|p| *packed(p, 0).4 = 8),
            // Integer operands must have the role the op reads them as.
            ("as SeqOffsets", &|p| *packed(p, 2).0 = BufId(2)), // the positions
            ("as Positions", &|p| {
                let ids = match &p.ops[0] {
                    Op::EmbedLayerNorm(e) => e.ids,
                    _ => unreachable!(),
                };
                *packed(p, 0).1 = ids;
            }),
            ("as TokenIds", &|p| {
                if let Op::EmbedLayerNorm(EmbedLayerNorm {
                    ids, token_types, ..
                }) = &mut p.ops[0]
                {
                    std::mem::swap(token_types, ids);
                }
            }),
            ("needs an i32 buffer", &|p| {
                let x = match &p.ops[4] {
                    Op::Pool(pool) => pool.x,
                    _ => unreachable!(),
                };
                *packed(p, 4).0 = x;
            }),
            // Aliasing.
            ("out aliases qkv", &|p| {
                if let Op::Attention(Attention { qkv, out, .. }) = &mut p.ops[2] {
                    *out = *qkv;
                }
            }),
            ("out aliases x", &|p| {
                if let Op::Pool(Pool { x, out, .. }) = &mut p.ops[4] {
                    *out = *x;
                }
            }),
        ];
        for (want, edit) in edits {
            let mut p = base.clone();
            edit(&mut p);
            check(&p, &w, want);
        }
        // Sizes of inputs, activations and the output.
        let mut p = base.clone();
        p.buffers[3].elems = 4; // offsets: seqs + 1 = 5
        check(&p, &w, "offsets");
        let mut p = base.clone();
        p.buffers[2].elems = 33;
        check(&p, &w, "expected 32");
        let mut p = base.clone();
        p.buffers[5].elems = 32 * 3 * 8 - 1; // qkv
        check(&p, &w, "needs 768 elements");
        // Packed programs have no mask or feature input; padded ones no offsets.
        let mut p = base.clone();
        p.buffers[1].kind = BufKind::Input(InputRole::AttentionMask);
        check(&p, &w, "as TokenTypeIds");
        let with_input = |p: &Program, name: &str, role: InputRole, elems: usize| {
            let mut p = p.clone();
            p.inputs.push(BufId(p.buffers.len()));
            p.buffers.push(super::super::BufferDecl {
                name: name.into(),
                kind: BufKind::Input(role),
                elems,
            });
            p
        };
        let p = with_input(&base, "mask", InputRole::AttentionMask, 32);
        check(&p, &w, "in a packed program");
        let p = with_input(&padded, "offsets", InputRole::SeqOffsets, 3);
        check(&p, &pw, "in a padded program");
        // Read before write of the varlen attention's output.
        let mut p = base.clone();
        p.ops.remove(2);
        check(&p, &w, "before any op writes it");
    }

    #[test]
    fn packed_batches_are_checked_against_the_budget() {
        let (p, w) = packed_encoder(16, 3, 8, Pooling::Mean);
        let f = p.validate(&w).unwrap();
        for ok in [
            BatchRows::Tokens(vec![vec![1; 8], vec![2; 8]]), // budget filled exactly
            BatchRows::Tokens(vec![vec![1; 8], vec![], vec![2; 8]]), // and an empty sequence
            BatchRows::Tokens(vec![vec![9]]),                // nearly empty
            BatchRows::Tokens(vec![vec![], vec![], vec![]]), // only empty sequences
        ] {
            f.check_rows(&ok).unwrap();
        }
        let cases = [
            (
                BatchRows::Tokens(vec![vec![1; 8], vec![2; 8], vec![3]]),
                "budget of 16",
            ),
            (BatchRows::Tokens(vec![vec![1]; 4]), "4 sequences"),
            (
                BatchRows::Tokens(vec![vec![1; 9]]),
                "more than the graph's seq of 8",
            ),
            (
                BatchRows::Tokens(vec![vec![1, 10]]),
                "outside the vocabulary",
            ),
            (BatchRows::Tokens(vec![]), "no rows"),
        ];
        for (rows, want) in cases {
            let e = f.check_rows(&rows).unwrap_err().to_string();
            assert!(e.contains(want), "{rows:?}: {e}");
        }
    }

    /// The reference interpreter gives a packed program exactly what it
    /// gives the padded program of the same model on the same sequences:
    /// the two layouts compute the same function.
    #[test]
    fn packed_and_padded_programs_agree_in_the_reference() {
        let rows = BatchRows::Tokens(vec![
            vec![1, 5, 3, 2],
            vec![7],
            vec![],
            vec![4, 4, 9, 8, 1, 2, 3, 6],
        ]);
        for mode in [Pooling::Mean, Pooling::Cls, Pooling::Max] {
            let (mut padded, w) = encoder(4, 8);
            if let Some(Op::Pool(Pool { mode: m, .. })) = padded.ops.last_mut() {
                *m = mode;
            }
            let w = filled(&w);
            padded.validate(&w).unwrap();
            let want = super::super::reference::run(&padded, &w, crate::tensor::DType::F32, &rows);
            for (tokens, seqs) in [(13, 4), (16, 5), (40, 9)] {
                let (packed, _) = packed_encoder(tokens, seqs, 8, mode);
                packed.validate(&w).unwrap();
                let got =
                    super::super::reference::run(&packed, &w, crate::tensor::DType::F32, &rows);
                assert_eq!(got.len(), 4 * 8);
                for (r, (g, p)) in got.chunks(8).zip(want.chunks(8)).enumerate() {
                    // The padded Cls of an empty row reads its (padding) first
                    // slot; the packed one is zeros by definition.
                    if r == 2 {
                        assert!(g.iter().all(|&v| v == 0.0), "{mode:?}: {g:?}");
                        continue;
                    }
                    for (a, b) in g.iter().zip(p) {
                        assert!(
                            (a - b).abs() < 1e-6,
                            "{mode:?} ({tokens}, {seqs}) row {r}: {g:?} vs {p:?}"
                        );
                    }
                    assert!(g.iter().any(|&v| v != 0.0));
                }
            }
        }
    }

    #[test]
    fn well_formed_programs_give_their_facts() {
        let (p, w) = linear(4);
        let f = p.validate(&w).unwrap();
        assert_eq!(f.input, ProgramInput::Features { width: 4 });
        assert_eq!((f.batch, f.seq), (4, 1));
        let (p, w) = encoder(2, 8);
        assert_eq!(
            p.validate(&w).unwrap().input,
            ProgramInput::Tokens {
                vocab: 10,
                types: 2
            }
        );
    }

    #[test]
    fn every_op_that_reads_what_it_writes_is_refused() {
        let (mut p, w) = linear(2);
        let Op::Linear(Linear { x, out, .. }) = &mut p.ops[0] else {
            unreachable!()
        };
        *out = *x;
        assert!(
            error(&p, &w).contains("writes an input"),
            "{}",
            error(&p, &w)
        );

        let (base, w) = encoder(1, 4);
        // Attention's out = qkv.
        let mut p = base.clone();
        if let Op::Attention(Attention { qkv, out, .. }) = &mut p.ops[2] {
            *out = *qkv;
        }
        assert!(error(&p, &w).contains("out aliases qkv"));
        // AddLayerNorm's out = x (out = residual is allowed: the base does it).
        let mut p = base.clone();
        if let Op::AddLayerNorm(AddLayerNorm { x, out, .. }) = &mut p.ops[3] {
            *out = *x;
        }
        assert!(error(&p, &w).contains("out aliases x"));
        // Linear's out = x, on activations.
        let mut p = base.clone();
        if let Op::Linear(Linear { x, out, .. }) = &mut p.ops[1] {
            *x = *out;
        }
        assert!(error(&p, &w).contains("reads and writes the same buffer"));
        // Pool's out = x is refused (x is an activation, out must differ).
        let mut p = base;
        if let Op::Pool(Pool { x, out, .. }) = &mut p.ops[4] {
            *out = *x;
        }
        assert!(error(&p, &w).contains("out aliases x"));
    }

    #[test]
    fn shapes_kinds_and_tables_are_checked() {
        // The position table must hold `seq` rows (16 here).
        let (p, w) = encoder(1, 17);
        assert!(error(&p, &w).contains("pos"), "{}", error(&p, &w));
        encoder(1, 16).0.validate(&encoder(1, 16).1).unwrap();
        // A float buffer as the mask.
        let (mut p, w) = encoder(1, 4);
        if let Op::Attention(Attention {
            qkv,
            seqs: Seqs::Padded { mask, .. },
            ..
        }) = &mut p.ops[2]
        {
            *mask = *qkv;
        }
        assert!(error(&p, &w).contains("needs an i32 buffer"));
        // Zero dimensions.
        let (mut p, w) = linear(2);
        if let Op::Linear(Linear { n, .. }) = &mut p.ops[0] {
            *n = 0;
        }
        assert!(error(&p, &w).contains("zero dimension"));
        // An output of the wrong size, a second output, an unlisted input.
        let (mut p, w) = linear(2);
        p.output_dim = 4;
        assert!(error(&p, &w).contains("output"));
        let (mut p, w) = linear(2);
        p.buffers.push(super::super::BufferDecl {
            name: "y2".into(),
            kind: BufKind::Output,
            elems: 6,
        });
        assert!(error(&p, &w).contains("second output"));
        let (mut p, w) = linear(2);
        p.inputs.clear();
        assert!(error(&p, &w).contains("not in the input list"));
        // Reading an activation nothing wrote.
        let (mut p, w) = encoder(1, 4);
        p.ops.remove(1);
        assert!(error(&p, &w).contains("before any op writes it"));
    }

    #[test]
    fn batches_are_checked_against_the_program() {
        let (p, w) = linear(4);
        let f = p.validate(&w).unwrap();
        let features = |features, data| BatchRows::Features { features, data };
        let ok = features(4, vec![1.0; 8]);
        f.check_rows(&ok).unwrap();
        for c in [
            features(4, vec![]),
            features(4, vec![1.0; 20]),
            features(5, vec![1.0; 10]),
            features(4, vec![1.0; 7]),
            BatchRows::Tokens(vec![vec![1, 2]]),
        ] {
            assert!(f.check_rows(&c).is_err(), "{c:?}");
        }
        let (p, w) = encoder(2, 8);
        let f = p.validate(&w).unwrap();
        f.check_rows(&BatchRows::Tokens(vec![vec![1, 5, 2], vec![1, 2]]))
            .unwrap();
        // Empty sequences are allowed (they pool to zeros).
        f.check_rows(&BatchRows::Tokens(vec![vec![], vec![1]]))
            .unwrap();
        for c in [
            BatchRows::Tokens(vec![vec![1; 9]]),
            BatchRows::Tokens(vec![vec![1]; 3]),
            BatchRows::Tokens(vec![]),
            BatchRows::Tokens(vec![vec![1, 10]]),
            BatchRows::Tokens(vec![vec![u32::MAX]]),
            BatchRows::Features {
                features: 4,
                data: vec![0.0; 4],
            },
        ] {
            assert!(f.check_rows(&c).is_err(), "{c:?}");
        }
    }

    #[test]
    fn the_reference_interpreter_runs_a_validated_program() {
        let (p, _) = linear(2);
        let mut w = Weights::new();
        w.push("w", vec![3, 4], (0..12).map(|i| i as f32).collect());
        p.validate(&w).unwrap();
        let rows = BatchRows::Features {
            features: 4,
            data: vec![1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0],
        };
        let out = super::super::reference::run(&p, &w, crate::tensor::DType::F32, &rows);
        // Row 0 picks column 0 of each output row; row 1 sums columns 1 and 2.
        assert_eq!(out, vec![0.0, 4.0, 8.0, 3.0, 11.0, 19.0]);
        let (p, w) = encoder(1, 4);
        p.validate(&w).unwrap();
        let out = super::super::reference::run(
            &p,
            &w,
            crate::tensor::DType::F32,
            &BatchRows::Tokens(vec![vec![1, 2, 3]]),
        );
        assert_eq!(out.len(), 8);
    }
}
