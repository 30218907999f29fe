//! Zero-copy staging: a small graph's first kernel reads the batch's input
//! block from its pinned host slot and its last writes the output there, so
//! a replay needs no copy before or after it ([`KernelPath::StagedIo`]).
//! The embedding and the pooling do it themselves where they can
//! ([`KernelPath::StageFold`]); a block small enough travels as the first
//! kernel's parameter ([`KernelPath::InlineInput`]); the host learns the
//! output has arrived by polling it ([`KernelPath::PollOutput`]).

use super::{Arg, Limits, Loc, Plan, StagedCount, StagedStep, Step};
use crate::config::KernelPath;
use crate::model::program::Layout;

/// What the host writes over a staged batch's output before the launch
/// ([`Plan::poll_output`]): a negative NaN with every payload bit set, a bit
/// pattern the kernels' arithmetic never produces (a computed NaN is the
/// canonical 0x7fffffff), so a value that is no longer this was written by
/// the graph. PCIe writes of aligned words do not tear.
pub const OUTPUT_SENTINEL: u32 = 0xffff_ffff;

/// Words of the input block a staged graph's first kernel takes as its
/// parameter ([`KernelPath::InlineInput`]; `INLINE_WORDS` of
/// kernels/common.cuh): 512 bytes, the padded (1, 16), (1, 32) and (2, 16)
/// MiniLM buckets (ids, types and mask), where a short text lands at light
/// load. A larger parameter would cost every launch of the graph its copy.
pub const INLINE_WORDS: usize = 128;

/// The largest input block a graph stages through its own kernels
/// ([`Plan::fits_staged_io`]); it is read whole at every replay.
pub const STAGED_INPUT_MAX_BYTES: usize = 64 * 1024;
/// The largest output a graph stages: `stage_out` writes only the batch's
/// rows, so this covers the small packed budgets (64 tokens, 64 sequences of
/// 384 floats: 96 KiB) where a lone short text lands.
pub const STAGED_OUTPUT_MAX_BYTES: usize = 128 * 1024;
/// Threads of a block of `stage_in` / `stage_out`.
pub const STAGE_THREADS: u32 = 256;

impl Plan {
    /// Whether the graph of this plan stages its inputs and output through
    /// its own kernels ([`Plan::with_staged_io`]): an input block of at most
    /// [`STAGED_INPUT_MAX_BYTES`] and an output of at most
    /// [`STAGED_OUTPUT_MAX_BYTES`], where the copy engine's fixed cost per
    /// copy is more than moving the bytes; larger ones keep the copies.
    pub fn fits_staged_io(&self) -> bool {
        self.input_bytes > 0
            && self.input_bytes <= STAGED_INPUT_MAX_BYTES
            && self.input_bytes.is_multiple_of(4)
            && self.output_elems > 0
            && self.output_elems * 4 <= STAGED_OUTPUT_MAX_BYTES
    }

    /// The plan a graph captures: staged ([`Plan::with_staged_io`]) where it
    /// [fits](Plan::fits_staged_io) and [`KernelPath::StagedIo`] is on, as it
    /// is otherwise (the replay then copies its input block in and its
    /// output out).
    pub fn for_graph(self, limits: &Limits) -> Plan {
        if limits.on(KernelPath::StagedIo) && self.fits_staged_io() {
            self.with_staged_io(limits)
        } else {
            self
        }
    }

    /// The plan with zero-copy staging: its first step reads the input block
    /// from the batch's pinned slot ([`Loc::StagedInput`]) and its last
    /// writes the output into the slot ([`Loc::StagedOutput`]), so a replay
    /// needs no copy before or after it.
    ///
    /// Where the first step is `embed_ln_vec` it does the staging itself (it
    /// copies the block to the static inputs for the later kernels, and
    /// reads its own ids from the slot), and where the last is `pool_ln` or
    /// `pool_packed_ln` writing the whole output it writes into the slot;
    /// otherwise a kernel `stage_in` goes first and `stage_out` last (plain
    /// kernels of the graph; the first step is never a programmatic launch,
    /// the one after it waits in `pdl_wait` as every kernel does). Each
    /// folded end is one dependent node fewer (~0.8 µs on an H200,
    /// scripts/gpu/probe-io-copies.cu).
    pub fn with_staged_io(mut self, limits: &Limits) -> Plan {
        let fold = limits.on(KernelPath::StageFold);
        let words = self.input_bytes.div_ceil(4);
        let inline = limits.on(KernelPath::InlineInput) && words <= INLINE_WORDS;
        let grid = |n: usize| (n.div_ceil(STAGE_THREADS as usize).clamp(1, 64) as u32, 1, 1);
        let unique = |steps: &[Step], name: &str| {
            steps
                .iter()
                .filter(|s| matches!(s, Step::Kernel { name: n, .. } if n == name))
                .count()
                == 1
        };
        let steps = &mut self.steps;
        let fold_in = match steps.first() {
            Some(Step::Kernel { name, args, .. }) if fold => {
                name.starts_with("embed_ln_vec_")
                    && unique(steps, name)
                    && args.len() == 20
                    && args[16..] == [Arg::Null, Arg::Null, Arg::I32(0), Arg::I32(0)]
            }
            _ => false,
        };
        if fold_in {
            let Some(Step::Kernel { name, args, .. }) = steps.first_mut() else {
                unreachable!("checked above")
            };
            // Packed plans: the next kernel (gemm_small) reads the live rows
            // from the inputs before its pdl_wait, so it may launch only
            // once the copy is visible (vec.cu).
            let sync = matches!(self.layout, Layout::Packed { .. });
            let stage = [
                Arg::Ptr(Loc::Input(0)),
                Arg::I32(words as i32),
                Arg::I32(sync as i32),
            ];
            // ids, types, positions (or none): word offsets in the block.
            let offsets = args[..3].iter().map(|a| match *a {
                Arg::Ptr(Loc::Input(o)) if o % 4 == 0 => Some((o / 4) as i32),
                Arg::Null => Some(-1),
                _ => None,
            });
            let offsets: Option<Vec<i32>> = offsets.collect();
            match offsets {
                Some(o) if inline && o[0] >= 0 && o[1] >= 0 => {
                    let mut a = vec![Arg::Inline, Arg::I32(o[0]), Arg::I32(o[1]), Arg::I32(o[2])];
                    a.extend_from_slice(&args[3..16]);
                    a.extend(stage);
                    *args = a;
                    *name = name.replacen("embed_ln_vec_", "embed_ln_vec_inl_", 1);
                }
                _ => {
                    for a in args.iter_mut() {
                        if let Arg::Ptr(Loc::Input(o)) = *a {
                            *a = Arg::Ptr(Loc::StagedInput(o));
                        }
                    }
                    args.truncate(16);
                    args.push(Arg::Ptr(Loc::StagedInput(0)));
                    args.extend(stage);
                }
            }
        } else {
            let src = if inline {
                Arg::Inline
            } else {
                Arg::Ptr(Loc::StagedInput(0))
            };
            steps.insert(
                0,
                Step::Kernel {
                    name: if inline { "stage_in_inl" } else { "stage_in" }.into(),
                    grid: grid(words),
                    block: (STAGE_THREADS, 1, 1),
                    smem: 0,
                    args: vec![src, Arg::Ptr(Loc::Input(0)), Arg::I32(words as i32)],
                },
            );
        }
        self.staged.push(StagedStep {
            step: 0,
            count: None,
        });
        self.poll_output = limits.on(KernelPath::PollOutput);
        // pool_ln / pool_packed_ln: (x, mask or offsets, out, ..., out_rows).
        let rows = self.output_elems / self.output_dim.max(1);
        let fold_out = match steps.last() {
            Some(Step::Kernel {
                name, args, grid, ..
            }) if fold => {
                (name.starts_with("pool_ln_") || name.starts_with("pool_packed_ln_"))
                    && unique(steps, name)
                    && args.len() == 11
                    && args[2] == Arg::Ptr(Loc::Output(0))
                    && args[10] == Arg::I32(rows as i32)
                    && grid.0 as usize == rows
                    && rows * self.output_dim == self.output_elems
            }
            _ => false,
        };
        if fold_out {
            let last = steps.len() - 1;
            let Some(Step::Kernel { args, .. }) = steps.last_mut() else {
                unreachable!("checked above")
            };
            args[2] = Arg::Ptr(Loc::StagedOutput(0));
            self.staged.push(StagedStep {
                step: last,
                count: Some((10, StagedCount::Rows)),
            });
        } else {
            let g = grid(self.output_elems);
            steps.push(Step::Kernel {
                name: "stage_out".into(),
                grid: g,
                block: (STAGE_THREADS, 1, 1),
                smem: 0,
                args: vec![
                    Arg::Ptr(Loc::Output(0)),
                    Arg::Ptr(Loc::StagedOutput(0)),
                    Arg::I32(self.output_elems as i32),
                ],
            });
            self.staged.push(StagedStep {
                step: steps.len() - 1,
                count: Some((2, StagedCount::Values)),
            });
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;

    /// The staged steps of a plan whose embedding (step 0) and pooling
    /// (step `last`, its `out_rows` argument the count) address the slot.
    fn folded_ends(last: usize) -> Vec<StagedStep> {
        vec![
            StagedStep {
                step: 0,
                count: None,
            },
            StagedStep {
                step: last,
                count: Some((10, StagedCount::Rows)),
            },
        ]
    }

    /// Small graphs stage their inputs and output through their own first
    /// and last kernels: the embedding and the pooling where they can (no
    /// extra node), `stage_in` / `stage_out` where they cannot; large ones
    /// keep the copies. (Here with the block read from the slot; the inline
    /// block and the polled output are
    /// `small_plans_take_their_input_inline_and_poll_their_output`'s.)
    #[test]
    fn small_plans_stage_their_io_in_the_graph() {
        let (a, w) = minilm(6);
        let default = LIMITS;
        let slot_io = LIMITS.without(&[KernelPath::InlineInput]);
        let small = planned(&a.program(1, 16), &w, DType::F16, default);
        assert!(small.fits_staged_io(), "{} bytes in", small.input_bytes);
        assert!(small.staged.is_empty());
        let staged = small.clone().with_staged_io(&slot_io);
        // Both ends folded: the same kernels, no node more.
        assert_eq!(staged.step_names(), small.step_names());
        let last = staged.steps.len() - 1;
        assert_eq!(staged.staged, folded_ends(last));
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        let ids = small.inputs[0].offset;
        let types = small.inputs[2].offset;
        assert_eq!(
            &args[..3],
            &[
                Arg::Ptr(Loc::StagedInput(ids)),
                Arg::Ptr(Loc::StagedInput(types)),
                Arg::Null
            ]
        );
        assert_eq!(
            &args[args.len() - 4..],
            &[
                Arg::Ptr(Loc::StagedInput(0)),
                Arg::Ptr(Loc::Input(0)),
                Arg::I32((small.input_bytes / 4) as i32),
                Arg::I32(0) // padded: the next kernel reads no input early
            ]
        );
        let Step::Kernel { args, .. } = &staged.steps[last] else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(args[2], Arg::Ptr(Loc::StagedOutput(0)));
        assert_eq!(args[10], Arg::I32(1));
        // Nothing else names the slot: the later kernels read the static
        // inputs the embedding copied.
        let names_slot = |p: &Plan| -> Vec<usize> {
            (0..p.steps.len())
                .filter(|&i| match &p.steps[i] {
                    Step::Kernel { args, .. } => args
                        .iter()
                        .any(|a| matches!(a, Arg::Ptr(Loc::StagedInput(_) | Loc::StagedOutput(_)))),
                    Step::Matmul { .. } => false,
                })
                .collect()
        };
        assert_eq!(names_slot(&staged), vec![0, last]);
        // The first step is a plain launch, the rest wait in pdl_wait.
        assert!(!staged.programmatic(0));
        assert!(staged.programmatic(1));

        // f32: the embedding folds, the pooling (no deferred LayerNorm) does
        // not: stage_out writes the output.
        let f32 = planned(&a.program(1, 16), &w, DType::F32, default);
        assert!(f32.fits_staged_io());
        let staged = f32.clone().with_staged_io(&slot_io);
        let names = staged.step_names();
        assert_eq!(names.len(), f32.node_count() + 1);
        assert_eq!(names[0], "embed_ln_vec_f32");
        assert_eq!(names.last().map(String::as_str), Some("stage_out"));
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("stage_out is a kernel")
        };
        assert_eq!(
            args,
            &[
                Arg::Ptr(Loc::Output(0)),
                Arg::Ptr(Loc::StagedOutput(0)),
                Arg::I32(f32.output_elems as i32),
            ]
        );
        assert_eq!(
            staged.staged[1],
            StagedStep {
                step: names.len() - 1,
                count: Some((2, StagedCount::Values))
            }
        );
        assert!(staged.programmatic(names.len() - 1));

        // Without the warp-per-row embedding, stage_in goes first.
        let no_vec = LIMITS.without(&[KernelPath::LnVec]);
        let plain = planned(&a.program(1, 16), &w, DType::F16, no_vec);
        let staged = plain.clone().with_staged_io(&slot_io);
        let names = staged.step_names();
        assert_eq!(names[0], "stage_in");
        assert_eq!(&names[1..], &plain.step_names()[..]);
        let Step::Kernel { args, grid, .. } = &staged.steps[0] else {
            panic!("stage_in is a kernel")
        };
        assert_eq!(
            args,
            &[
                Arg::Ptr(Loc::StagedInput(0)),
                Arg::Ptr(Loc::Input(0)),
                Arg::I32((plain.input_bytes / 4) as i32)
            ]
        );
        assert!(grid.0 >= 1);
        assert!(!staged.programmatic(0));
        assert!(staged.programmatic(1));

        // (128, 128): 192 KiB of inputs, 192 KiB of output: copies.
        let large = planned(&a.program(128, 128), &w, DType::F16, default);
        assert!(!large.fits_staged_io());
        // The smallest packed budget (64 tokens, up to 64 sequences), where
        // a lone short text runs in the daemon, is staged at both ends; its
        // pooling writes as many rows as the batch has (64 at capture).
        let packed = planned(&a.packed_program(64, 64), &w, DType::F16, default);
        assert!(
            packed.fits_staged_io(),
            "{} bytes in, {} floats out",
            packed.input_bytes,
            packed.output_elems
        );
        let staged = packed.clone().with_staged_io(&slot_io);
        assert_eq!(staged.step_names(), packed.step_names());
        let names = staged.step_names();
        assert!(names[0].starts_with("embed_ln_vec_"), "{names:?}");
        assert!(
            names[names.len() - 1].starts_with("pool_packed_ln_"),
            "{names:?}"
        );
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(
            (args[2], args[10]),
            (Arg::Ptr(Loc::StagedOutput(0)), Arg::I32(64))
        );
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(
            args[args.len() - 1],
            Arg::I32(1),
            "packed: the copy synchronised"
        );
        // `stage_fold` off: stage_in and stage_out around the same kernels.
        let names = small
            .clone()
            .with_staged_io(&slot_io.without(&[KernelPath::StageFold]))
            .step_names();
        assert_eq!(names.len(), small.node_count() + 2);
        assert_eq!(
            (names[0].as_str(), names[names.len() - 1].as_str()),
            ("stage_in", "stage_out")
        );
    }

    /// By default a staged graph whose input block fits [`INLINE_WORDS`]
    /// takes it as its first kernel's parameter (ids, types and positions
    /// as word offsets into it), and the host polls its output; a larger
    /// block is read from the slot. With `poll_output` off the host waits
    /// for the graph's event.
    #[test]
    fn small_plans_take_their_input_inline_and_poll_their_output() {
        let (a, w) = minilm(6);
        let default = LIMITS;
        let small = planned(&a.program(1, 16), &w, DType::F16, default);
        assert_eq!(small.input_bytes, 3 * 16 * 4, "ids, mask, types");
        let staged = small.clone().with_staged_io(&default);
        assert!(staged.poll_output);
        assert_eq!(staged.steps.len(), small.steps.len());
        assert_eq!(staged.step_names()[0], "embed_ln_vec_inl_f16");
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        let word = |i: usize| Arg::I32((small.inputs[i].offset / 4) as i32);
        assert_eq!(args.len(), 20, "the kernel's parameters");
        assert_eq!(&args[..4], &[Arg::Inline, word(0), word(2), Arg::I32(-1)]);
        let Step::Kernel { args: unstaged, .. } = &small.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(&args[4..17], &unstaged[3..16], "tables, shape: unchanged");
        assert_eq!(
            &args[17..],
            &[Arg::Ptr(Loc::Input(0)), Arg::I32(48), Arg::I32(0)]
        );
        // No step reads the slot's input block; the pooling writes the
        // output.
        assert!(staged.steps.iter().all(|s| match s {
            Step::Kernel { args, .. } => !args.contains(&Arg::Ptr(Loc::StagedInput(0))),
            Step::Matmul { .. } => true,
        }));
        let Some(Step::Kernel { args, .. }) = staged.steps.last() else {
            panic!("the pooling is a kernel")
        };
        assert_eq!(args.len(), 11);
        assert_eq!(args[2], Arg::Ptr(Loc::StagedOutput(0)));
        assert_eq!(staged.staged, folded_ends(staged.steps.len() - 1));

        // (2, 32): 192 words, over INLINE_WORDS: read from the slot.
        let two = planned(&a.program(2, 32), &w, DType::F16, default);
        assert_eq!(two.input_bytes / 4, 3 * 64);
        let staged = two.clone().with_staged_io(&default);
        assert_eq!(staged.step_names()[0], "embed_ln_vec_f16");
        let Step::Kernel { args, .. } = &staged.steps[0] else {
            panic!("the embedding is a kernel")
        };
        assert_eq!(args[16], Arg::Ptr(Loc::StagedInput(0)));

        // Without the warp-per-row embedding: stage_in_inl takes the block.
        let no_vec = default.without(&[KernelPath::LnVec]);
        let plain = planned(&a.program(1, 16), &w, DType::F16, no_vec);
        let staged = plain.clone().with_staged_io(&no_vec);
        let Step::Kernel { name, args, .. } = &staged.steps[0] else {
            panic!("stage_in_inl is a kernel")
        };
        assert_eq!(name, "stage_in_inl");
        assert_eq!(args, &[Arg::Inline, Arg::Ptr(Loc::Input(0)), Arg::I32(48)]);

        // The switches.
        let off = default.without(&[KernelPath::InlineInput, KernelPath::PollOutput]);
        let staged = small.clone().with_staged_io(&off);
        assert_eq!(staged.step_names()[0], "embed_ln_vec_f16");
        assert!(!staged.poll_output);
    }

    /// The host's INLINE_WORDS is the kernels' (the parameter's size).
    #[test]
    fn inline_words_match_the_kernels() {
        let common = include_str!("../../../../kernels/common.cuh");
        assert!(
            common.contains(&format!("#define INLINE_WORDS {INLINE_WORDS}\n")),
            "kernels/common.cuh defines another INLINE_WORDS"
        );
    }
}
