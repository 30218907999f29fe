//! A captured program: its static buffers allocated once, and the op list
//! bound to those buffers and the weights, ready to replay.
//!
//! [`Plan::new`] is the CPU backend's "capture": it allocates the program's
//! own static buffers (inputs and output) at their declared sizes, lays its
//! activation buffers out in an [`Arena`] shared by every plan of the backend
//! (only one plan runs at a time), and sizes attention's score scratch (also
//! in the arena). The program has passed
//! [`Program::validate`](crate::model::Program::validate), so every index is
//! in bounds and no step reads what it writes. [`Plan::pack`] writes a batch
//! (checked by [`ProgramFacts::check_rows`](crate::model::ProgramFacts::check_rows))
//! into the static inputs and [`Plan::run`] executes the steps over the same
//! buffers every time, allocating nothing.
//!
//! Packed programs (see [`crate::model::program`]) bind the same way; their
//! token ops run per sequence over the offsets the batch was packed with,
//! and trimming computes only the batch's real tokens (the first
//! `offsets[last]` slots) and real sequences.

use super::arena::{Arena, ArenaNeeds, ARENA_ALIGN};
use super::ops::{self, SeqIndex};
use super::{round_through, CpuWeights};
use crate::model::program::validate::op_buffers;
use crate::model::program::{BufKind, InputRole, Layout, Op, Program, Seqs, WeightId};
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

/// The shape a plan computes: its program's, or a batch's real part of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// `batch` rows of `seq` tokens.
    Padded { batch: usize, seq: usize },
    /// The first `tokens` slots and `seqs` sequences of a packed program.
    Packed { seqs: usize, tokens: usize },
}

impl Shape {
    /// (token rows, sentence rows).
    fn rows(self) -> (usize, usize) {
        match self {
            Shape::Padded { batch, seq } => (batch * seq, batch),
            Shape::Packed { seqs, tokens } => (tokens, seqs),
        }
    }
}

/// `op` restricted to the `active` part of a program of shape `full`: the
/// first rows of fewer tokens (padded), or the first tokens and sequences
/// (packed); `None` if one of the op's row counts is not one of the
/// program's (then the plan never trims).
fn restrict(op: &Op, full: Shape, active: Shape) -> Option<Op> {
    let (full_tokens, full_sentences) = full.rows();
    let (tokens, sentences) = active.rows();
    // Row counts scale with the token rows or the sentence rows (both,
    // when the two are equal: then computing the larger is safe).
    let rows = |r: usize| match (r == full_tokens, r == full_sentences) {
        (true, true) => Some(tokens.max(sentences)),
        (true, false) => Some(tokens),
        (false, true) => Some(sentences),
        (false, false) => None,
    };
    let seqs = |s: Seqs| -> Option<Seqs> {
        Some(match (s, full, active) {
            (
                Seqs::Padded { mask, batch, seq },
                Shape::Padded { batch: fb, seq: fs },
                Shape::Padded {
                    batch: ab,
                    seq: as_,
                },
            ) if (batch, seq) == (fb, fs) => Seqs::Padded {
                mask,
                batch: ab,
                seq: as_,
            },
            (
                Seqs::Packed {
                    offsets,
                    positions,
                    tokens: t,
                    seqs: n,
                    max_seq_len,
                },
                Shape::Packed {
                    seqs: fseqs,
                    tokens: ftokens,
                },
                Shape::Packed {
                    seqs: aseqs,
                    tokens: atokens,
                },
            ) if (t, n) == (ftokens, fseqs) => Seqs::Packed {
                offsets,
                positions,
                tokens: atokens,
                seqs: aseqs,
                max_seq_len,
            },
            _ => return None,
        })
    };
    let mut op = op.clone();
    if let Some(s) = op.seqs_mut() {
        *s = seqs(*s)?;
    }
    match &mut op {
        Op::Linear(l) => l.m = rows(l.m)?,
        Op::AddLayerNorm(a) => a.rows = rows(a.rows)?,
        Op::Normalize(n) => n.rows = rows(n.rows)?,
        Op::LayerNorm(l) => l.rows = rows(l.rows)?,
        Op::Add(a) => a.rows = rows(a.rows)?,
        Op::Gated(g) => g.rows = rows(g.rows)?,
        Op::RmsNorm(n) => n.rows = rows(n.rows)?,
        Op::HeadRmsNorm(n) => n.rows = rows(n.rows)?,
        Op::EmbedLayerNorm(_) | Op::Attention(_) | Op::Pool(_) | Op::Embed(_) | Op::Rotary(_) => {}
    }
    Some(op)
}

/// A program bound to preallocated buffers: its own static inputs and
/// output, and its activations at fixed offsets of the backend's [`Arena`].
#[derive(Debug)]
pub(crate) struct Plan {
    pub batch: usize,
    pub seq: usize,
    pub layout: Layout,
    pub output_dim: usize,
    weights: CpuWeights,
    /// Every buffer of the program, by index.
    slots: Vec<Slot>,
    /// The program's ops, in order (buffer and weight ids index `slots` and
    /// the weights).
    steps: Vec<Op>,
    /// (role, buffer) of each input.
    inputs: Vec<(InputRole, usize)>,
    output: usize,
    /// What it needs of the arena (activations, and attention's
    /// `workers · seq²` score scratch).
    needs: ArenaNeeds,
    threads: usize,
    /// Whether every step can be restricted to the real rows and tokens
    /// (see [`Plan::run`]).
    trimmable: bool,
    /// The shape the current batch was packed at.
    active: Shape,
}

impl Plan {
    /// Allocates the program's buffers and binds its ops to them
    /// ("capture"). `program` must have passed
    /// [`Program::validate`](crate::model::Program::validate) against the
    /// weights `weights` were uploaded from.
    pub(crate) fn new(program: &Program, weights: &CpuWeights, threads: usize) -> Plan {
        let (batch, seq) = (program.batch, program.seq);
        let steps = program.ops.clone();
        // Attention's score scratch: a (sequence, head) task's scores.
        let attention_scratch = steps
            .iter()
            .filter_map(|op| match op {
                Op::Attention(a) => Some(ops::attention_scratch(a.seqs.max_len())),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let inputs = program
            .inputs
            .iter()
            .map(|&id| match program.buffer(id).kind {
                BufKind::Input(role) => (role, id.0),
                kind => unreachable!("validated: inputs are Input buffers, not {kind:?}"),
            })
            .collect();

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
            scratch: workers * attention_scratch,
        };
        let full = full_shape(program.layout, batch, seq);
        let smallest = match full {
            Shape::Padded { .. } => Shape::Padded { batch: 1, seq: 1 },
            Shape::Packed { .. } => Shape::Packed { seqs: 1, tokens: 1 },
        };
        let trimmable = steps.iter().all(|s| restrict(s, full, smallest).is_some());
        Plan {
            batch,
            seq,
            layout: program.layout,
            output_dim: program.output_dim,
            weights: weights.clone(),
            slots,
            steps,
            inputs,
            output: program.output.0,
            needs,
            threads: workers,
            trimmable,
            active: full,
        }
    }

    /// The shape of the whole program.
    fn full(&self) -> Shape {
        full_shape(self.layout, self.batch, self.seq)
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

    /// Writes a validated batch into the static inputs.
    ///
    /// With `trim` (and a plan whose ops all allow it), the batch is packed
    /// at its own shape, the real rows × its longest sequence, at the start
    /// of each input, and [`Plan::run`] computes only that much; otherwise
    /// it is padded to the full (batch, seq) of the program. Rows are
    /// independent and attention only sees unmasked keys, so the real rows'
    /// results are the same either way (to float rounding); trimming only
    /// skips work whose results nobody reads.
    ///
    /// A packed batch is always written whole (its inputs' layout does not
    /// depend on trimming); trimming then computes its first
    /// `max(tokens, 1)` slots and its sequences only.
    pub(crate) fn pack(&mut self, rows: &BatchRows, trim: bool) {
        let trim = trim && self.trimmable;
        self.active = match self.full() {
            Shape::Packed { .. } if trim => Shape::Packed {
                seqs: rows.rows(),
                tokens: rows.tokens().max(1),
            },
            Shape::Padded { .. } if trim => {
                let seq = match rows {
                    BatchRows::Tokens(_) => rows.max_len().max(1),
                    BatchRows::Features { .. } => self.seq,
                };
                Shape::Padded {
                    batch: rows.rows(),
                    seq,
                }
            }
            full => full,
        };
        if let Layout::Packed { .. } = self.layout {
            for &(role, index) in &self.inputs {
                let Slot::Own(Buf::I32(v)) = &mut self.slots[index] else {
                    unreachable!("checked at capture: packed inputs are i32 static buffers")
                };
                rows.pack_packed(role, v);
            }
            return;
        }
        let Shape::Padded { batch, seq } = self.active else {
            unreachable!("a padded plan computes a padded shape")
        };
        for &(role, index) in &self.inputs {
            let Slot::Own(buf) = &mut self.slots[index] else {
                unreachable!("checked at capture: inputs are static buffers")
            };
            match buf {
                Buf::F32(v) => {
                    let width = v.len() / self.batch;
                    rows.pack_features(&mut v[..batch * width]);
                }
                Buf::I32(v) if role == InputRole::PoolSkip => rows.pack_tokens(role, seq, v),
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
        let wt = |w: WeightId| weights[w.0].data.as_slice();
        let dtype = self.weights.dtype();
        let full = self.full();
        let active = self.active;
        let slots = &mut self.slots;
        let activations = &mut arena.activations[..];
        for full_step in &self.steps {
            let restricted;
            let step = if active == full {
                full_step
            } else {
                restricted =
                    restrict(full_step, full, active).expect("checked at capture: trimmable");
                &restricted
            };
            let (_, out) = op_buffers(step);
            let (o, bufs) = Reads::split(slots, activations, out.0);
            let seq_index = |s: Seqs| match s {
                Seqs::Padded { mask, batch, seq } => SeqIndex::Padded {
                    mask: &bufs.i32(mask.0)[..batch * seq],
                    seq,
                },
                Seqs::Packed {
                    offsets,
                    positions,
                    seqs,
                    max_seq_len,
                    ..
                } => SeqIndex::Packed {
                    offsets: &bufs.i32(offsets.0)[..seqs + 1],
                    positions: bufs.i32(positions.0),
                    max_len: max_seq_len,
                },
            };
            match step {
                Op::EmbedLayerNorm(e) => {
                    let rows = e.seqs.token_rows();
                    ops::embed_layer_norm(
                        threads,
                        &bufs.i32(e.ids.0)[..rows],
                        &bufs.i32(e.token_types.0)[..rows],
                        seq_index(e.seqs),
                        wt(e.word),
                        wt(e.position),
                        wt(e.token_type),
                        wt(e.gamma),
                        wt(e.beta),
                        e.eps,
                        o,
                        e.hidden,
                        e.position_ids,
                    )
                }
                Op::Linear(l) => ops::linear(
                    threads,
                    bufs.f32(l.x.0),
                    wt(l.w),
                    l.bias.map(wt),
                    l.act,
                    o,
                    l.m,
                    l.n,
                    l.k,
                ),
                Op::AddLayerNorm(a) => {
                    if a.residual != a.out {
                        let n = a.rows * a.hidden;
                        o[..n].copy_from_slice(&bufs.f32(a.residual.0)[..n]);
                    }
                    ops::add_layer_norm_in_place(
                        threads,
                        bufs.f32(a.x.0),
                        o,
                        wt(a.gamma),
                        wt(a.beta),
                        a.eps,
                        a.rows,
                        a.hidden,
                    );
                }
                Op::Attention(a) => {
                    let chunk = ops::attention_scratch(a.seqs.max_len());
                    ops::attention(
                        bufs.f32(a.qkv.0),
                        seq_index(a.seqs),
                        o,
                        &mut arena.scratch[..threads * chunk],
                        a.seqs.token_rows(),
                        a,
                        a.bias.map(|b| (wt(b.table), b.radius)),
                    );
                }
                Op::Pool(p) => ops::pool(
                    bufs.f32(p.x.0),
                    seq_index(p.seqs),
                    o,
                    p.hidden,
                    p.mode,
                    p.normalize,
                    p.skip.map(|k| &bufs.i32(k.0)[..p.seqs.count()]),
                ),
                Op::Normalize(n) => ops::normalize_rows(&mut o[..n.rows * n.width], n.width),
                Op::Embed(e) => {
                    let rows = e.seqs.token_rows();
                    let scale = round_through(dtype, e.scale);
                    ops::embed(
                        threads,
                        &bufs.i32(e.ids.0)[..rows],
                        wt(e.word),
                        scale,
                        o,
                        e.hidden,
                    )
                }
                Op::LayerNorm(l) => {
                    if l.x != l.out {
                        let n = l.rows * l.hidden;
                        o[..n].copy_from_slice(&bufs.f32(l.x.0)[..n]);
                    }
                    ops::layer_norm_in_place(
                        threads,
                        o,
                        wt(l.gamma),
                        l.beta.map(wt),
                        l.eps,
                        l.rows,
                        l.hidden,
                    );
                }
                Op::Add(a) => ops::add(threads, bufs.f32(a.x.0), o, a.rows * a.width, a.width),
                Op::Rotary(r) => ops::rotary(threads, o, seq_index(r.seqs), r.seqs.token_rows(), r),
                Op::Gated(g) => {
                    ops::gated(threads, bufs.f32(g.x.0), o, g.rows, g.width, g.act, g.on)
                }
                Op::RmsNorm(n) => {
                    if n.x != n.out {
                        let len = n.rows * n.hidden;
                        o[..len].copy_from_slice(&bufs.f32(n.x.0)[..len]);
                    }
                    ops::rms_norm_in_place(threads, o, wt(n.gamma), n.weight_offset, n.eps, n.rows);
                }
                Op::HeadRmsNorm(n) => ops::head_rms_norm(
                    threads,
                    o,
                    n.rows,
                    n.heads,
                    n.kv_heads,
                    wt(n.q_gamma),
                    wt(n.k_gamma),
                    n.weight_offset,
                    n.eps,
                ),
            }
        }
    }
}

/// The shape of a whole program of `layout`, `batch` and `seq`.
fn full_shape(layout: Layout, batch: usize, seq: usize) -> Shape {
    match layout {
        Layout::Padded => Shape::Padded { batch, seq },
        Layout::Packed { tokens } => Shape::Packed {
            seqs: batch,
            tokens,
        },
    }
}
