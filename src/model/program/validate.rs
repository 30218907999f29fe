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
//!   position table of at least `seq` rows.
//! * Inputs: each listed input is an `Input` buffer and every `Input`
//!   buffer is listed; a feature input holds whole rows of the batch; a
//!   token input holds exactly `batch · seq` elements. A program has either
//!   one feature input, or token inputs whose ids an embedding reads.
//! * There is exactly one `Output` buffer, the program's output, of exactly
//!   `batch · output_dim` elements.
//!
//! [`ProgramFacts::check_rows`] then checks a batch: at least one and at most
//! `batch` rows, sequences of at most `seq` tokens with ids inside the
//! vocabulary, feature rows of the input's width.

use super::{BufId, BufKind, InputRole, Op, Program, WeightId};
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
    /// Token ids below this vocabulary size (the word embedding's rows).
    Tokens { vocab: usize },
}

/// What validation learned about a program: enough to check batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramFacts {
    pub batch: usize,
    pub seq: usize,
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

impl Checker<'_> {
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

    fn distinct(&self, read: BufId, write: BufId, names: &str) -> Result<(), ProgramError> {
        if read == write {
            return invalid(format!("{}: {names}", self.what));
        }
        Ok(())
    }

    fn weight(&self, id: WeightId, shape: &[usize]) -> Result<(), ProgramError> {
        let what = &self.what;
        if id.0 >= self.weights.len() {
            return invalid(format!(
                "{what} refers to weight {} which does not exist",
                id.0
            ));
        }
        let t = self.weights.get(id);
        if t.shape != shape {
            return invalid(format!(
                "{what}: weight `{}` has shape {:?}, the op needs {shape:?}",
                t.name, t.shape
            ));
        }
        Ok(())
    }

    /// An embedding table `[rows ≥ min_rows, width]`; returns its rows.
    fn table(&self, id: WeightId, min_rows: usize, width: usize) -> Result<usize, ProgramError> {
        let what = &self.what;
        if id.0 >= self.weights.len() {
            return invalid(format!(
                "{what} refers to weight {} which does not exist",
                id.0
            ));
        }
        let t = self.weights.get(id);
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
    match *op {
        Op::EmbedLayerNorm {
            ids,
            token_types,
            out,
            ..
        } => (vec![ids, token_types], out),
        Op::Linear { x, out, .. } => (vec![x], out),
        Op::AddLayerNorm {
            x, residual, out, ..
        } => (vec![x, residual], out),
        Op::Attention { qkv, mask, out, .. } => (vec![qkv, mask], out),
        Op::Pool { x, mask, out, .. } => (vec![x, mask], out),
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
        let mut vocab = None;
        let mut written = vec![false; self.buffers.len()];
        for (i, op) in self.ops.iter().enumerate() {
            let c = Checker {
                program: self,
                weights,
                what: format!("op {i} ({})", op_name(op)),
            };
            self.validate_op(&c, op, &mut vocab)?;
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
        let input = self.validate_inputs(vocab)?;
        self.validate_output()?;
        Ok(ProgramFacts { batch, seq, input })
    }

    fn validate_op(
        &self,
        c: &Checker<'_>,
        op: &Op,
        vocab: &mut Option<usize>,
    ) -> Result<(), ProgramError> {
        match *op {
            Op::EmbedLayerNorm {
                ids,
                token_types,
                word,
                position,
                token_type,
                gamma,
                beta,
                out,
                batch,
                seq,
                hidden,
                ..
            } => {
                c.positive(&[batch, seq, hidden])?;
                let rows = batch * seq;
                c.buf(ids, rows, true)?;
                c.buf(token_types, rows, true)?;
                *vocab = Some(c.table(word, 1, hidden)?);
                c.table(position, seq, hidden)?;
                c.table(token_type, 1, hidden)?;
                c.weight(gamma, &[hidden])?;
                c.weight(beta, &[hidden])?;
                c.out(out, rows * hidden)
            }
            Op::Linear {
                x,
                w,
                bias,
                out,
                m,
                n,
                k,
                ..
            } => {
                c.positive(&[m, n, k])?;
                c.buf(x, m * k, false)?;
                c.weight(w, &[n, k])?;
                if let Some(b) = bias {
                    c.weight(b, &[n])?;
                }
                c.out(out, m * n)?;
                c.distinct(x, out, "reads and writes the same buffer")
            }
            Op::AddLayerNorm {
                x,
                residual,
                gamma,
                beta,
                out,
                rows,
                hidden,
                ..
            } => {
                c.positive(&[rows, hidden])?;
                c.distinct(x, out, "out aliases x")?;
                c.buf(x, rows * hidden, false)?;
                c.buf(residual, rows * hidden, false)?;
                c.weight(gamma, &[hidden])?;
                c.weight(beta, &[hidden])?;
                c.out(out, rows * hidden)
            }
            Op::Attention {
                qkv,
                mask,
                out,
                batch,
                seq,
                heads,
                head_dim,
            } => {
                c.positive(&[batch, seq, heads, head_dim])?;
                c.distinct(qkv, out, "out aliases qkv")?;
                let rows = batch * seq;
                c.buf(qkv, rows * 3 * heads * head_dim, false)?;
                c.buf(mask, rows, true)?;
                c.out(out, rows * heads * head_dim)
            }
            Op::Pool {
                x,
                mask,
                out,
                batch,
                seq,
                hidden,
                ..
            } => {
                c.positive(&[batch, seq, hidden])?;
                c.distinct(x, out, "out aliases x")?;
                c.buf(x, batch * seq * hidden, false)?;
                c.buf(mask, batch * seq, true)?;
                c.out(out, batch * hidden)
            }
        }
    }

    fn validate_inputs(&self, vocab: Option<usize>) -> Result<ProgramInput, ProgramError> {
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
            if role == InputRole::Features {
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
            (None, Some(vocab)) if has_ids => Ok(ProgramInput::Tokens { vocab }),
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
        Op::EmbedLayerNorm { .. } => "EmbedLayerNorm",
        Op::Linear { .. } => "Linear",
        Op::AddLayerNorm { .. } => "AddLayerNorm",
        Op::Attention { .. } => "Attention",
        Op::Pool { .. } => "Pool",
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
            return bad(format!(
                "{n} rows do not fit the graph's batch of {}",
                self.batch
            ));
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
            (BatchRows::Tokens(seqs), ProgramInput::Tokens { vocab }) => {
                for (i, ids) in seqs.iter().enumerate() {
                    if ids.len() > self.seq {
                        return bad(format!(
                            "row {i} has {} tokens, more than the graph's seq of {}",
                            ids.len(),
                            self.seq
                        ));
                    }
                    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
                        return bad(format!(
                            "row {i} has token id {id}, outside the vocabulary of {vocab}"
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
