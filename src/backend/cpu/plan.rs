//! A captured program: its static buffers allocated once, and the op list
//! resolved and checked against those buffers and the weights, ready to
//! replay.
//!
//! [`Plan::new`] is the CPU backend's "capture": it allocates the program's
//! own static buffers (inputs and output) at their declared sizes, lays its
//! activation buffers out in an [`Arena`] shared by every plan of the backend
//! (only one plan runs at a time), checks every op (buffer kinds and sizes,
//! weight shapes, aliasing, no activation read before it is written) so that
//! replay cannot index out of bounds or see another plan's data, and sizes
//! attention's score scratch (also in the arena). [`Plan::validate`] checks a
//! batch against the plan (rows, sequence lengths, token ids, feature width),
//! [`Plan::pack`] writes it into the static inputs and [`Plan::run`] executes
//! the steps over the same buffers every time, allocating nothing.

use super::ops;
use super::CpuWeights;
use crate::backend::BackendError;
use crate::model::program::{
    Activation, BufId, BufKind, InputRole, Op, Pooling, Program, WeightId,
};
use crate::model::BatchRows;

/// A static buffer: integer inputs are i32, everything else f32.
#[derive(Debug)]
enum Buf {
    F32(Vec<f32>),
    I32(Vec<i32>),
}

impl Buf {
    fn f32(&self) -> &[f32] {
        match self {
            Buf::F32(v) => v,
            Buf::I32(_) => unreachable!("checked at capture: f32 buffer"),
        }
    }
    fn f32_mut(&mut self) -> &mut [f32] {
        match self {
            Buf::F32(v) => v,
            Buf::I32(_) => unreachable!("checked at capture: f32 buffer"),
        }
    }
    fn i32(&self) -> &[i32] {
        match self {
            Buf::I32(v) => v,
            Buf::F32(_) => unreachable!("checked at capture: i32 buffer"),
        }
    }
    fn bytes(&self) -> usize {
        match self {
            Buf::F32(v) => v.len() * 4,
            Buf::I32(v) => v.len() * 4,
        }
    }
}

/// Where a program buffer lives.
#[derive(Debug)]
enum Slot {
    /// The plan's own static buffer (inputs and the output).
    Own(Buf),
    /// `len` f32 elements at `offset` in the backend's [`Arena`] (activations).
    Arena { offset: usize, len: usize },
}

/// Arena offsets are rounded up to this many f32 elements (a 64-byte cache line).
const ARENA_ALIGN: usize = 16;

/// What a plan needs of the [`Arena`], in f32 elements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ArenaNeeds {
    /// Its activation buffers, laid out one after another from offset 0.
    pub activations: usize,
    /// Attention's score scratch: `workers · seq²`.
    pub scratch: usize,
}

impl ArenaNeeds {
    pub(crate) fn bytes(self) -> u64 {
        (self.activations + self.scratch) as u64 * 4
    }
}

/// Activation memory shared by every plan of a backend: one plan runs at a
/// time, and a plan never reads an activation it has not written in the same
/// run (checked at capture), so plans may overwrite each other's.
///
/// It only grows (to the largest need of the plans run in it) and never
/// shrinks.
#[derive(Debug, Default)]
pub(crate) struct Arena {
    activations: Vec<f32>,
    scratch: Vec<f32>,
}

impl Arena {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> u64 {
        (self.activations.len() + self.scratch.len()) as u64 * 4
    }

    /// Whether a plan with these needs can run without growing the arena.
    pub(crate) fn fits(&self, needs: ArenaNeeds) -> bool {
        self.activations.len() >= needs.activations && self.scratch.len() >= needs.scratch
    }

    /// Grows the arena to hold `needs`; returns the bytes it grew by (0 if it
    /// already fits). The contents are not kept (nothing reads them).
    pub(crate) fn ensure(&mut self, needs: ArenaNeeds) -> u64 {
        let before = self.bytes();
        for (v, need) in [
            (&mut self.activations, needs.activations),
            (&mut self.scratch, needs.scratch),
        ] {
            if v.len() < need {
                // Free first: the old contents need not be copied, and the
                // peak stays at the new size.
                *v = Vec::new();
                *v = vec![0.0; need];
            }
        }
        self.bytes() - before
    }
}

/// A slice with one range lent out mutably: the rest, readable.
struct Rest<'a, T> {
    before: &'a [T],
    after: &'a [T],
    /// The range lent out (`0..0` when nothing is).
    lent: std::ops::Range<usize>,
}

impl<'a, T> Rest<'a, T> {
    fn whole(all: &'a [T]) -> Self {
        Rest {
            before: &[],
            after: all,
            lent: 0..0,
        }
    }

    /// Lends out `range` of `all` mutably; the rest stays readable.
    fn split(all: &'a mut [T], range: std::ops::Range<usize>) -> (&'a mut [T], Self) {
        let (before, rest) = all.split_at_mut(range.start);
        let (lent, after) = rest.split_at_mut(range.len());
        (
            lent,
            Rest {
                before,
                after,
                lent: range,
            },
        )
    }

    /// `range`, which must not overlap the range lent out (capture checks
    /// that no step reads the buffer it writes).
    fn get(&self, range: std::ops::Range<usize>) -> &'a [T] {
        if range.end <= self.lent.start {
            &self.before[range]
        } else {
            assert!(
                range.start >= self.lent.end,
                "checked at capture: a step never reads the buffer it writes"
            );
            &self.after[range.start - self.lent.end..range.end - self.lent.end]
        }
    }
}

/// A plan's buffers while one step writes its output: every other buffer,
/// readable.
struct Reads<'a> {
    slots: Rest<'a, Slot>,
    arena: Rest<'a, f32>,
}

impl<'a> Reads<'a> {
    /// Lends out buffer `out` (an f32 buffer) mutably, and the rest for reading.
    fn split(slots: &'a mut [Slot], arena: &'a mut [f32], out: usize) -> (&'a mut [f32], Self) {
        let at = match slots[out] {
            Slot::Arena { offset, len } => Some(offset..offset + len),
            Slot::Own(_) => None,
        };
        match at {
            Some(range) => {
                let (o, arena) = Rest::split(arena, range);
                let slots = Rest::whole(slots);
                (o, Reads { slots, arena })
            }
            None => {
                let (o, slots) = Rest::split(slots, out..out + 1);
                let Slot::Own(buf) = &mut o[0] else {
                    unreachable!()
                };
                let arena = Rest::whole(arena);
                (buf.f32_mut(), Reads { slots, arena })
            }
        }
    }

    fn f32(&self, index: usize) -> &'a [f32] {
        match &self.slots.get(index..index + 1)[0] {
            Slot::Own(buf) => buf.f32(),
            Slot::Arena { offset, len } => self.arena.get(*offset..*offset + *len),
        }
    }

    fn i32(&self, index: usize) -> &'a [i32] {
        match &self.slots.get(index..index + 1)[0] {
            Slot::Own(buf) => buf.i32(),
            Slot::Arena { .. } => unreachable!("checked at capture: i32 buffer"),
        }
    }
}

/// One op bound to buffer and weight indices (all checked).
#[derive(Clone, Copy, Debug)]
enum Step {
    Embed {
        ids: usize,
        types: usize,
        word: usize,
        position: usize,
        token_type: usize,
        gamma: usize,
        beta: usize,
        eps: f32,
        out: usize,
        rows: usize,
        seq: usize,
        hidden: usize,
    },
    Linear {
        x: usize,
        w: usize,
        bias: Option<usize>,
        act: Activation,
        out: usize,
        m: usize,
        n: usize,
        k: usize,
    },
    AddNorm {
        x: usize,
        residual: usize,
        gamma: usize,
        beta: usize,
        eps: f32,
        out: usize,
        rows: usize,
        hidden: usize,
    },
    Attention {
        qkv: usize,
        mask: usize,
        out: usize,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
    },
    Pool {
        x: usize,
        mask: usize,
        out: usize,
        batch: usize,
        seq: usize,
        hidden: usize,
        mode: Pooling,
        normalize: bool,
    },
}

impl Step {
    /// The buffers the step reads, and the one it writes.
    fn buffers(self) -> ([Option<usize>; 2], usize) {
        match self {
            Step::Embed {
                ids, types, out, ..
            } => ([Some(ids), Some(types)], out),
            Step::Linear { x, out, .. } => ([Some(x), None], out),
            Step::AddNorm {
                x, residual, out, ..
            } => ([Some(x), Some(residual)], out),
            Step::Attention { qkv, mask, out, .. } => ([Some(qkv), Some(mask)], out),
            Step::Pool { x, mask, out, .. } => ([Some(x), Some(mask)], out),
        }
    }

    /// This step restricted to the first `active.0` rows of `active.1`
    /// tokens, for a program of `full.0` rows of `full.1` tokens; `None` if
    /// the step's shape is not one of the program's row counts (then the
    /// plan never trims).
    fn active(self, full: (usize, usize), active: (usize, usize)) -> Option<Step> {
        let (fb, fs) = full;
        let (ab, as_) = active;
        // Row counts scale with batch·seq (token rows) or batch (sentence rows).
        let rows = |r: usize| {
            if r == fb * fs {
                Some(ab * as_)
            } else if r == fb {
                Some(ab)
            } else {
                None
            }
        };
        let shape = |b: usize, s: usize| (b == fb && s == fs).then_some((ab, as_));
        Some(match self {
            Step::Embed {
                ids,
                types,
                word,
                position,
                token_type,
                gamma,
                beta,
                eps,
                out,
                rows: r,
                seq,
                hidden,
            } => {
                if seq != fs || r != fb * fs {
                    return None;
                }
                Step::Embed {
                    ids,
                    types,
                    word,
                    position,
                    token_type,
                    gamma,
                    beta,
                    eps,
                    out,
                    rows: ab * as_,
                    seq: as_,
                    hidden,
                }
            }
            Step::Linear {
                x,
                w,
                bias,
                act,
                out,
                m,
                n,
                k,
            } => Step::Linear {
                x,
                w,
                bias,
                act,
                out,
                m: rows(m)?,
                n,
                k,
            },
            Step::AddNorm {
                x,
                residual,
                gamma,
                beta,
                eps,
                out,
                rows: r,
                hidden,
            } => Step::AddNorm {
                x,
                residual,
                gamma,
                beta,
                eps,
                out,
                rows: rows(r)?,
                hidden,
            },
            Step::Attention {
                qkv,
                mask,
                out,
                batch,
                seq,
                heads,
                head_dim,
            } => {
                let (batch, seq) = shape(batch, seq)?;
                Step::Attention {
                    qkv,
                    mask,
                    out,
                    batch,
                    seq,
                    heads,
                    head_dim,
                }
            }
            Step::Pool {
                x,
                mask,
                out,
                batch,
                seq,
                hidden,
                mode,
                normalize,
            } => {
                let (batch, seq) = shape(batch, seq)?;
                Step::Pool {
                    x,
                    mask,
                    out,
                    batch,
                    seq,
                    hidden,
                    mode,
                    normalize,
                }
            }
        })
    }
}

/// What the inputs of a plan accept.
#[derive(Clone, Copy, Debug)]
enum InputKind {
    /// f32 rows of this width.
    Features(usize),
    /// Token ids below this vocabulary size (the word embedding's rows).
    Tokens { vocab: usize },
}

/// A program bound to preallocated buffers: its own static inputs and
/// output, and its activations at fixed offsets of the backend's [`Arena`].
#[derive(Debug)]
pub(crate) struct Plan {
    pub batch: usize,
    pub seq: usize,
    pub output_dim: usize,
    weights: CpuWeights,
    /// Every buffer of the program, by index.
    slots: Vec<Slot>,
    steps: Vec<Step>,
    /// (role, buffer) of each input.
    inputs: Vec<(InputRole, usize)>,
    input_kind: InputKind,
    output: usize,
    /// What it needs of the arena (activations, and attention's
    /// `workers · seq²` score scratch).
    needs: ArenaNeeds,
    threads: usize,
    /// Whether every step can be restricted to the real rows and tokens
    /// (see [`Plan::run`]).
    trimmable: bool,
    /// The (rows, tokens) the current batch was packed at.
    active: (usize, usize),
}

fn invalid_program(message: impl Into<String>) -> BackendError {
    BackendError::Other(format!("invalid program: {}", message.into()))
}

/// Checks buffer/weight references of a program against its declarations.
struct Checker<'a> {
    program: &'a Program,
    weights: &'a CpuWeights,
}

impl Checker<'_> {
    fn buf(
        &self,
        id: BufId,
        what: &str,
        need: usize,
        integer: bool,
    ) -> Result<usize, BackendError> {
        let decl = self.program.buffers.get(id.0).ok_or_else(|| {
            invalid_program(format!(
                "{what} refers to buffer {} which is not declared",
                id.0
            ))
        })?;
        let is_integer = matches!(decl.kind, BufKind::Input(role) if role.is_integer());
        if is_integer != integer {
            return Err(invalid_program(format!(
                "{what} needs an {} buffer, `{}` is {:?}",
                if integer { "i32" } else { "f32" },
                decl.name,
                decl.kind
            )));
        }
        if decl.elems < need {
            return Err(invalid_program(format!(
                "{what} needs {need} elements, `{}` has {}",
                decl.name, decl.elems
            )));
        }
        Ok(id.0)
    }

    /// An f32 buffer an op writes (not an input).
    fn out(&self, id: BufId, what: &str, need: usize) -> Result<usize, BackendError> {
        let index = self.buf(id, what, need, false)?;
        if matches!(self.program.buffers[index].kind, BufKind::Input(_)) {
            return Err(invalid_program(format!("{what} writes an input buffer")));
        }
        Ok(index)
    }

    fn weight(&self, id: WeightId, what: &str, shape: &[usize]) -> Result<usize, BackendError> {
        let t = self.weights.tensors.get(id.0).ok_or_else(|| {
            invalid_program(format!(
                "{what} refers to weight {} which does not exist",
                id.0
            ))
        })?;
        let elems: usize = shape.iter().product();
        if t.data.len() != elems {
            return Err(invalid_program(format!(
                "{what}: weight `{}` has shape {:?}, the op needs {shape:?}",
                t.name, t.shape
            )));
        }
        Ok(id.0)
    }

    /// A weight whose rows are indexed (embedding tables): `[rows ≥ min_rows, width]`.
    fn table(
        &self,
        id: WeightId,
        what: &str,
        min_rows: usize,
        width: usize,
    ) -> Result<(usize, usize), BackendError> {
        let t = self.weights.tensors.get(id.0).ok_or_else(|| {
            invalid_program(format!(
                "{what} refers to weight {} which does not exist",
                id.0
            ))
        })?;
        let rows = t.data.len().checked_div(width).unwrap_or(0);
        if t.shape.len() != 2 || t.shape[1] != width || rows < min_rows {
            return Err(invalid_program(format!(
                "{what}: weight `{}` has shape {:?}, the op needs [≥{min_rows}, {width}]",
                t.name, t.shape
            )));
        }
        Ok((id.0, rows))
    }
}

fn positive(what: &str, dims: &[usize]) -> Result<(), BackendError> {
    if dims.contains(&0) {
        return Err(invalid_program(format!(
            "{what} has a zero dimension {dims:?}"
        )));
    }
    Ok(())
}

impl Plan {
    /// Allocates the program's buffers and resolves its ops ("capture").
    pub(crate) fn new(
        program: &Program,
        weights: &CpuWeights,
        threads: usize,
    ) -> Result<Plan, BackendError> {
        let c = Checker { program, weights };
        let (batch, seq) = (program.batch, program.seq);
        positive("the program", &[batch, seq])?;
        let mut steps = Vec::with_capacity(program.ops.len());
        let mut vocab = None;
        let mut max_attention_seq = 0;
        // Activations live in the shared arena, where another plan may have
        // left anything: each must be written before it is read.
        let mut written = vec![false; program.buffers.len()];
        for (i, op) in program.ops.iter().enumerate() {
            let what = |name: &str| format!("op {i} ({name})");
            let step = match *op {
                Op::EmbedLayerNorm {
                    ids,
                    token_types,
                    word,
                    position,
                    token_type,
                    gamma,
                    beta,
                    eps,
                    out,
                    batch,
                    seq,
                    hidden,
                } => {
                    let w = what("EmbedLayerNorm");
                    positive(&w, &[batch, seq, hidden])?;
                    let rows = batch * seq;
                    let (word, vocab_rows) = c.table(word, &w, 1, hidden)?;
                    vocab = Some(vocab_rows);
                    // Token types are all 0 (the packer writes zeros).
                    Step::Embed {
                        ids: c.buf(ids, &w, rows, true)?,
                        types: c.buf(token_types, &w, rows, true)?,
                        word,
                        position: c
                            .table(position, &format!("{w} position table"), seq, hidden)?
                            .0,
                        token_type: c.table(token_type, &w, 1, hidden)?.0,
                        gamma: c.weight(gamma, &w, &[hidden])?,
                        beta: c.weight(beta, &w, &[hidden])?,
                        eps,
                        out: c.out(out, &w, rows * hidden)?,
                        rows,
                        seq,
                        hidden,
                    }
                }
                Op::Linear {
                    x,
                    w: weight,
                    bias,
                    act,
                    out,
                    m,
                    n,
                    k,
                } => {
                    let w = what("Linear");
                    positive(&w, &[m, n, k])?;
                    let step = Step::Linear {
                        x: c.buf(x, &w, m * k, false)?,
                        w: c.weight(weight, &w, &[n, k])?,
                        bias: bias.map(|b| c.weight(b, &w, &[n])).transpose()?,
                        act,
                        out: c.out(out, &w, m * n)?,
                        m,
                        n,
                        k,
                    };
                    if x == out {
                        return Err(invalid_program(format!(
                            "{w} reads and writes the same buffer"
                        )));
                    }
                    step
                }
                Op::AddLayerNorm {
                    x,
                    residual,
                    gamma,
                    beta,
                    eps,
                    out,
                    rows,
                    hidden,
                } => {
                    let w = what("AddLayerNorm");
                    positive(&w, &[rows, hidden])?;
                    if x == out {
                        return Err(invalid_program(format!("{w}: out aliases x")));
                    }
                    Step::AddNorm {
                        x: c.buf(x, &w, rows * hidden, false)?,
                        residual: c.buf(residual, &w, rows * hidden, false)?,
                        gamma: c.weight(gamma, &w, &[hidden])?,
                        beta: c.weight(beta, &w, &[hidden])?,
                        eps,
                        out: c.out(out, &w, rows * hidden)?,
                        rows,
                        hidden,
                    }
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
                    let w = what("Attention");
                    positive(&w, &[batch, seq, heads, head_dim])?;
                    if qkv == out {
                        return Err(invalid_program(format!("{w}: out aliases qkv")));
                    }
                    let rows = batch * seq;
                    max_attention_seq = max_attention_seq.max(seq);
                    Step::Attention {
                        qkv: c.buf(qkv, &w, rows * 3 * heads * head_dim, false)?,
                        mask: c.buf(mask, &w, rows, true)?,
                        out: c.out(out, &w, rows * heads * head_dim)?,
                        batch,
                        seq,
                        heads,
                        head_dim,
                    }
                }
                Op::Pool {
                    x,
                    mask,
                    out,
                    batch,
                    seq,
                    hidden,
                    mode,
                    normalize,
                } => {
                    let w = what("Pool");
                    positive(&w, &[batch, seq, hidden])?;
                    if x == out {
                        return Err(invalid_program(format!("{w}: out aliases x")));
                    }
                    Step::Pool {
                        x: c.buf(x, &w, batch * seq * hidden, false)?,
                        mask: c.buf(mask, &w, batch * seq, true)?,
                        out: c.out(out, &w, batch * hidden)?,
                        batch,
                        seq,
                        hidden,
                        mode,
                        normalize,
                    }
                }
            };
            let (reads, out) = step.buffers();
            for index in reads.into_iter().flatten() {
                let decl = &program.buffers[index];
                if decl.kind == BufKind::Activation && !written[index] {
                    return Err(invalid_program(format!(
                        "op {i} reads activation `{}` before any op writes it",
                        decl.name
                    )));
                }
            }
            written[out] = true;
            steps.push(step);
        }

        // Inputs and the output.
        let mut inputs = Vec::with_capacity(program.inputs.len());
        let mut features = None;
        for &id in &program.inputs {
            let decl = program
                .buffers
                .get(id.0)
                .ok_or_else(|| invalid_program(format!("input buffer {} is not declared", id.0)))?;
            let BufKind::Input(role) = decl.kind else {
                return Err(invalid_program(format!(
                    "`{}` is listed as an input but is {:?}",
                    decl.name, decl.kind
                )));
            };
            if role == InputRole::Features {
                if decl.elems == 0 || decl.elems % batch != 0 {
                    return Err(invalid_program(format!(
                        "feature input `{}` has {} elements, not a multiple of batch {batch}",
                        decl.name, decl.elems
                    )));
                }
                features = Some(decl.elems / batch);
            } else if decl.elems != batch * seq {
                return Err(invalid_program(format!(
                    "token input `{}` has {} elements, expected batch·seq = {}",
                    decl.name,
                    decl.elems,
                    batch * seq
                )));
            }
            inputs.push((role, id.0));
        }
        let input_kind = match (features, vocab) {
            (Some(width), None) => InputKind::Features(width),
            (None, Some(vocab)) if inputs.iter().any(|(r, _)| *r == InputRole::TokenIds) => {
                InputKind::Tokens { vocab }
            }
            _ => {
                return Err(invalid_program(
                    "expected either one feature input, or token inputs read by an embedding",
                ))
            }
        };
        let out_decl = program
            .buffers
            .get(program.output.0)
            .ok_or_else(|| invalid_program("the output buffer is not declared"))?;
        if out_decl.kind != BufKind::Output || out_decl.elems < batch * program.output_dim {
            return Err(invalid_program(format!(
                "output `{}` must be an Output buffer of at least batch·output_dim = {} elements",
                out_decl.name,
                batch * program.output_dim
            )));
        }

        // Allocate the static buffers once; lay the activations out in the arena.
        let mut activations = 0;
        let slots = program
            .buffers
            .iter()
            .map(|decl| match decl.kind {
                BufKind::Input(role) if role.is_integer() => {
                    Slot::Own(Buf::I32(vec![0; decl.elems]))
                }
                BufKind::Input(_) | BufKind::Output => Slot::Own(Buf::F32(vec![0.0; decl.elems])),
                BufKind::Activation => {
                    let offset = activations;
                    activations += decl.elems.next_multiple_of(ARENA_ALIGN);
                    Slot::Arena {
                        offset,
                        len: decl.elems,
                    }
                }
            })
            .collect();
        let workers = threads.max(1);
        let needs = ArenaNeeds {
            activations,
            scratch: workers * max_attention_seq * max_attention_seq,
        };
        let trimmable = steps
            .iter()
            .all(|s| s.active((batch, seq), (1, 1)).is_some());
        Ok(Plan {
            batch,
            seq,
            output_dim: program.output_dim,
            weights: weights.clone(),
            slots,
            steps,
            inputs,
            input_kind,
            output: program.output.0,
            needs,
            threads: workers,
            trimmable,
            active: (batch, seq),
        })
    }

    /// Bytes of the plan's own static buffers (inputs and output).
    pub(crate) fn static_bytes(&self) -> u64 {
        self.slots
            .iter()
            .map(|slot| match slot {
                Slot::Own(buf) => buf.bytes() as u64,
                Slot::Arena { .. } => 0,
            })
            .sum()
    }

    /// What the plan needs of the arena it runs in.
    pub(crate) fn arena_needs(&self) -> ArenaNeeds {
        self.needs
    }

    /// Checks that `rows` fits this plan; every later step relies on it.
    pub(crate) fn validate(&self, rows: &BatchRows) -> Result<(), BackendError> {
        let invalid = |m: String| Err(BackendError::InvalidBatch(m));
        let n = rows.rows();
        if n == 0 {
            return invalid("the batch has no rows".into());
        }
        if n > self.batch {
            return invalid(format!(
                "{n} rows do not fit the graph's batch of {}",
                self.batch
            ));
        }
        match (rows, self.input_kind) {
            (BatchRows::Features { features, data }, InputKind::Features(width)) => {
                if *features != width {
                    return invalid(format!(
                        "rows have {features} features, the model takes {width}"
                    ));
                }
                if data.len() != n * width {
                    return invalid(format!(
                        "{} feature values are not whole rows of {width}",
                        data.len()
                    ));
                }
            }
            (BatchRows::Tokens(seqs), InputKind::Tokens { vocab }) => {
                for (i, ids) in seqs.iter().enumerate() {
                    if ids.len() > self.seq {
                        return invalid(format!(
                            "row {i} has {} tokens, more than the graph's seq of {}",
                            ids.len(),
                            self.seq
                        ));
                    }
                    if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
                        return invalid(format!(
                            "row {i} has token id {id}, outside the vocabulary of {vocab}"
                        ));
                    }
                }
            }
            (BatchRows::Features { .. }, InputKind::Tokens { .. }) => {
                return invalid("feature rows sent to a token model".into());
            }
            (BatchRows::Tokens(_), InputKind::Features(_)) => {
                return invalid("token rows sent to a feature model".into());
            }
        }
        Ok(())
    }

    /// Writes a validated batch into the static inputs.
    ///
    /// With `trim` (and a plan whose ops all allow it), the batch is packed
    /// at its own shape, the real rows × its longest sequence, at the start
    /// of each input, and [`Plan::run`] computes only that much; otherwise
    /// it is padded to the full (batch, seq) of the program. Rows are
    /// independent and attention only sees unmasked keys, so the real rows'
    /// results are the same either way (to float rounding); trimming only
    /// skips work whose results nobody reads.
    pub(crate) fn pack(&mut self, rows: &BatchRows, trim: bool) {
        self.active = if trim && self.trimmable {
            let seq = match rows {
                BatchRows::Tokens(_) => rows.max_len().max(1),
                BatchRows::Features { .. } => self.seq,
            };
            (rows.rows(), seq)
        } else {
            (self.batch, self.seq)
        };
        let (batch, seq) = self.active;
        for &(role, index) in &self.inputs {
            let Slot::Own(buf) = &mut self.slots[index] else {
                unreachable!("checked at capture: inputs are static buffers")
            };
            match buf {
                Buf::F32(v) => {
                    let width = v.len() / self.batch;
                    rows.pack_features(&mut v[..batch * width]);
                }
                Buf::I32(v) => rows.pack_tokens(role, seq, &mut v[..batch * seq]),
            }
        }
    }

    /// The real rows of the output after a run.
    pub(crate) fn output_rows(&self, rows: usize) -> &[f32] {
        let Slot::Own(buf) = &self.slots[self.output] else {
            unreachable!("checked at capture: the output is a static buffer")
        };
        &buf.f32()[..rows * self.output_dim]
    }

    /// Runs every step over the static buffers and `arena`, at the shape the
    /// last [`Plan::pack`] chose. Call inside the backend's pool, with an
    /// arena that fits [`Plan::arena_needs`].
    pub(crate) fn run(&mut self, arena: &mut Arena) {
        assert!(
            arena.fits(self.needs),
            "the caller grows the arena to the plan's needs"
        );
        let threads = self.threads;
        let weights = &self.weights.tensors;
        let wt = |i: usize| weights[i].data.as_slice();
        let full = (self.batch, self.seq);
        let active = self.active;
        let slots = &mut self.slots;
        let activations = &mut arena.activations[..];
        for i in 0..self.steps.len() {
            let step = if active == full {
                self.steps[i]
            } else {
                self.steps[i]
                    .active(full, active)
                    .expect("checked at capture: trimmable")
            };
            let (_, out) = step.buffers();
            let (o, bufs) = Reads::split(slots, activations, out);
            match step {
                Step::Embed {
                    ids,
                    types,
                    word,
                    position,
                    token_type,
                    gamma,
                    beta,
                    eps,
                    out: _,
                    rows,
                    seq,
                    hidden,
                } => ops::embed_layer_norm(
                    threads,
                    &bufs.i32(ids)[..rows],
                    &bufs.i32(types)[..rows],
                    wt(word),
                    wt(position),
                    wt(token_type),
                    wt(gamma),
                    wt(beta),
                    eps,
                    o,
                    seq,
                    hidden,
                ),
                Step::Linear {
                    x,
                    w,
                    bias,
                    act,
                    out: _,
                    m,
                    n,
                    k,
                } => ops::linear(threads, bufs.f32(x), wt(w), bias.map(wt), act, o, m, n, k),
                Step::AddNorm {
                    x,
                    residual,
                    gamma,
                    beta,
                    eps,
                    out,
                    rows,
                    hidden,
                } => {
                    if residual != out {
                        let n = rows * hidden;
                        o[..n].copy_from_slice(&bufs.f32(residual)[..n]);
                    }
                    ops::add_layer_norm_in_place(
                        threads,
                        bufs.f32(x),
                        o,
                        wt(gamma),
                        wt(beta),
                        eps,
                        rows,
                        hidden,
                    );
                }
                Step::Attention {
                    qkv,
                    mask,
                    out: _,
                    batch,
                    seq,
                    heads,
                    head_dim,
                } => {
                    let scratch_len = threads * seq * seq;
                    ops::attention(
                        bufs.f32(qkv),
                        bufs.i32(mask),
                        o,
                        &mut arena.scratch[..scratch_len],
                        batch,
                        seq,
                        heads,
                        head_dim,
                    );
                }
                Step::Pool {
                    x,
                    mask,
                    out: _,
                    batch,
                    seq,
                    hidden,
                    mode,
                    normalize,
                } => ops::pool(
                    bufs.f32(x),
                    bufs.i32(mask),
                    o,
                    batch,
                    seq,
                    hidden,
                    mode,
                    normalize,
                ),
            }
        }
    }
}
