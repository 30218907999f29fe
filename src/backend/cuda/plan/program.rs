//! The assembly of a plan: the program's inputs laid out in the static
//! input block, its activations in the arena, each op handed to the
//! function of its stage in order, and the [`Plan`] that results.

use super::planner::Planner;
use super::{InputSlot, Limits, Loc, Plan, INT_INPUT_ALIGN, MAX_COUNTERS};
use crate::backend::cuda::mem::{align_up, ALIGN};
use crate::backend::BackendError;
use crate::config::KernelPath;
use crate::model::program::{BufId, BufKind, InputRole, Op};
use crate::model::{Program, Weights};
use crate::tensor::DType;
use std::collections::HashMap;

fn input_align(role: InputRole) -> usize {
    if role == InputRole::Features {
        ALIGN
    } else {
        INT_INPUT_ALIGN
    }
}

/// What of `op` the CUDA kernels cannot run, refused for the whole program
/// before anything is planned (so a graph never computes a model as if it
/// were another). Issue 13's families plan onto their own kernels —
/// RoBERTa-style position ids (`embed_ln[_packed]_padpos`), MPNet's
/// relative attention bias (the `attention*_bias` kernels), pooling that
/// skips a prompt (`pool[_packed]_skip`) and `Normalize` (`l2norm_rows`).
/// The pre-norm, rotary ops of ModernBERT plan onto `prenorm.cu`
/// (`plan/prenorm.rs`); the decoders' (Qwen3, EmbeddingGemma) RMSNorms,
/// q/k norms, grouped-query, causal and rescaled attention, scaled
/// embedding and last-token pooling onto decoder.cu and the band attention
/// kernels (`plan/decoder.rs`, `plan/attention.rs`). A position bias
/// together with a sliding window, a causal mask, grouped-query heads or
/// heads over 128 (no model has both) is refused. Shape limits of one
/// device (shared memory, grid sizes) are refused where the op is planned.
pub fn not_on_cuda(op: &Op) -> Option<String> {
    match op {
        Op::Attention(a) if a.window.is_some() && a.bias.is_some() => {
            Some("sliding-window attention with a position bias has no CUDA kernel".to_string())
        }
        Op::Attention(a) if a.bias.is_some() && super::attention::is_band(a) => Some(
            "a position bias with causal or grouped-query attention, or heads over 128, has no CUDA kernel"
                .to_string(),
        ),
        _ => None,
    }
}

/// Plans `program` for compute type `compute`.
pub fn plan(
    program: &Program,
    weights: &Weights,
    compute: DType,
    tf32: bool,
    limits: Limits,
) -> Result<Plan, BackendError> {
    if !compute.is_float() {
        return Err(BackendError::Unsupported(format!(
            "compute dtype {compute}"
        )));
    }
    for (idx, op) in program.ops.iter().enumerate() {
        if let Some(why) = not_on_cuda(op) {
            return Err(BackendError::Unsupported(format!("op {idx}: {why}")));
        }
    }
    // The program has passed `Program::validate`: buffers, inputs and the
    // one output are as declared.
    let output_elems = program.batch * program.output_dim;
    let mut locs = HashMap::new();
    let mut inputs = Vec::new();
    let mut input_bytes = 0usize;
    for &id in &program.inputs {
        let decl = program.buffer(id);
        let BufKind::Input(role) = decl.kind else {
            unreachable!("validated: inputs are Input buffers")
        };
        locs.insert(id, Loc::Input(input_bytes));
        inputs.push(InputSlot {
            buf: id,
            role,
            elems: decl.elems,
            offset: input_bytes,
        });
        input_bytes += align_up(decl.elems * 4, input_align(role));
    }
    let mut arena = 0usize;
    for (i, decl) in program.buffers.iter().enumerate() {
        match decl.kind {
            BufKind::Activation => {
                locs.insert(BufId(i), Loc::Arena(arena));
                arena += align_up(decl.elems * compute.size(), ALIGN);
            }
            BufKind::Output => {
                locs.insert(BufId(i), Loc::Output(0));
            }
            BufKind::Input(_) => {}
        }
    }
    let activation_bytes = arena;
    let mut p = Planner {
        program,
        weights,
        compute,
        tf32,
        limits,
        locs,
        arena,
        counters: 0,
        fused_tmp: None,
        deferred_ln: None,
        steps: Vec::new(),
        input_bytes,
        tile_tables: Vec::new(),
    };
    let mut i = 0;
    while i < program.ops.len() {
        if let Some(d) = p.deferred_ln.as_ref().filter(|d| d.consumer != i) {
            return Err(BackendError::Other(format!(
                "planner: op {i} reached with op {}'s deferred LayerNorm unapplied",
                d.consumer
            )));
        }
        let op = &program.ops[i];
        // Each op to the function of its stage; a fused one may consume
        // the op after it too.
        i += match op {
            Op::EmbedLayerNorm(op) => p.embed(i, op)?,
            Op::Linear(op) => p.linear(i, op)?,
            Op::AddLayerNorm(op) => p.add_layer_norm(i, op)?,
            Op::Attention(op) => p.attention(i, op)?,
            Op::Pool(op) => p.pool(i, op)?,
            Op::Normalize(op) => p.normalize(i, op)?,
            Op::Embed(op) => p.embed_rows(i, op)?,
            Op::LayerNorm(op) => p.layer_norm(i, op)?,
            Op::Add(op) => p.add(i, op)?,
            Op::Rotary(op) => p.rotary(i, op)?,
            Op::Gated(op) => p.gated(i, op)?,
            Op::RmsNorm(op) => p.rms_norm(i, op)?,
            Op::HeadRmsNorm(op) => p.head_rms_norm(i, op)?,
        };
    }
    if p.deferred_ln.is_some() {
        return Err(BackendError::Other(
            "planner: a deferred LayerNorm has no op to apply it".into(),
        ));
    }
    if p.counters > MAX_COUNTERS {
        return Err(BackendError::Unsupported(format!(
            "{} fused ops in one program (at most {MAX_COUNTERS})",
            p.counters
        )));
    }
    Ok(Plan {
        compute,
        batch: program.batch,
        seq: program.seq,
        layout: program.layout,
        steps: p.steps,
        inputs,
        tile_tables: p.tile_tables,
        input_bytes: p.input_bytes,
        output_elems,
        output_dim: program.output_dim,
        activation_bytes,
        arena_bytes: p.arena.max(ALIGN),
        counters: p.counters,
        accum_bytes: p.fused_tmp.map_or(0, |(_, bytes)| bytes),
        pdl: p.limits.on(KernelPath::Pdl),
        staged: Vec::new(),
        poll_output: false,
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use crate::backend::cuda::mem::{align_up, ALIGN};
    use crate::backend::BackendError;

    #[test]
    fn packed_bert_plan() {
        let (tokens, seqs) = (1024, 32);
        let (p, w) = packed_bert_dims(tokens, seqs, 256, 384, 12, 1536);
        let plan = planned(&p, &w, DType::F16, LIMITS.without(&KernelPath::SMALL_SHAPE));
        assert_eq!(plan.layout, Layout::Packed { tokens: 1024 });
        assert_eq!((plan.batch, plan.seq), (32, 256));
        assert_eq!(plan.label(), "1024t (32 seqs of at most 256)");
        assert_eq!(
            plan.step_names(),
            vec![
                "embed_ln_packed_f16",
                "mm",
                "attention_varlen_tc_f16_d32",
                "mm",
                "add_ln_f16",
                "mm",
                "bias_act_f16_f16", // exact GELU
                "mm",
                "add_ln_f16",
                "pool_split_packed_f16",
            ]
        );
        assert_eq!(
            plan.inputs
                .iter()
                .map(|i| (i.role, i.elems))
                .collect::<Vec<_>>(),
            vec![
                (InputRole::TokenIds, 1024),
                (InputRole::TokenTypeIds, 1024),
                (InputRole::Positions, 1024),
                (InputRole::SeqOffsets, 33),
            ]
        );
        // One tile table (64-query tiles) after the inputs, in the input block.
        let tiles = max_tiles(tokens, seqs, 64);
        assert_eq!(tiles, 16 + 33);
        let after_inputs =
            3 * align_up(1024 * 4, INT_INPUT_ALIGN) + align_up(33 * 4, INT_INPUT_ALIGN);
        assert_eq!(
            plan.tile_tables,
            vec![TileTable {
                qt: 64,
                max_tiles: tiles,
                offset: after_inputs
            }]
        );
        assert_eq!(
            plan.input_bytes,
            after_inputs + align_up(tiles * TILE_ENTRY * 4, INT_INPUT_ALIGN)
        );
        let (_, grid, block, smem, args) = kernel(&plan, "embed_ln_packed");
        assert_eq!((grid, block, smem), ((1024, 1, 1), 96, 0));
        assert_eq!(
            &args[..3],
            &[
                Arg::Ptr(Loc::Input(0)),
                Arg::Ptr(Loc::Input(4096)),
                Arg::Ptr(Loc::Input(8192))
            ]
        );
        assert_eq!(
            &args[10..],
            &[Arg::I32(384), Arg::I32(1000), Arg::I32(512), Arg::I32(2)]
        );
        let (_, grid, block, smem, args) = kernel(&plan, "attention_varlen_tc");
        assert_eq!(
            (grid, block, smem),
            ((tiles as u32 * 12, 1, 1), TC_THREADS, 0)
        );
        let h = Loc::Arena(0);
        let qkv = Loc::Arena(align_up(1024 * 384 * 2, ALIGN));
        let ctx = Loc::Arena(align_up(1024 * 384 * 2, ALIGN) + align_up(1024 * 3 * 384 * 2, ALIGN));
        assert_eq!(
            args,
            &[
                Arg::Ptr(qkv),
                Arg::Ptr(Loc::Input(after_inputs)),
                Arg::Ptr(ctx),
                Arg::I32(12),
                Arg::F32(1.0 / (32f32).sqrt()),
                Arg::I32(1024),
            ]
        );
        // Sequences of up to 256 tokens: 8 blocks a sequence, each with its
        // partial row and count in scratch, a counter a sequence.
        let (_, grid, block, smem, args) = kernel(&plan, "pool_split_packed");
        assert_eq!((grid, block, smem), ((32, 8, 1), POOL_THREADS, 0));
        assert_eq!(
            &args[..8],
            &[
                Arg::Ptr(h),
                Arg::Ptr(Loc::Input(3 * 4096)),
                Arg::Null,
                Arg::Ptr(Loc::Output(0)),
                Arg::I32(1024),
                Arg::I32(384),
                Arg::I32(pool_code(Pooling::Mean)),
                Arg::I32(1),
            ]
        );
        assert!(matches!(args[8], Arg::Ptr(Loc::Arena(_))));
        assert!(matches!(args[9], Arg::Ptr(Loc::Arena(_))));
        assert_eq!(args[10], Arg::Ptr(Loc::Counter(0)));
        assert_eq!(plan.counters, 32);
        // Without the path: one block a sequence.
        let one =
            LIMITS.without(&[&KernelPath::SMALL_SHAPE[..], &[KernelPath::PoolSplit]].concat());
        let plan1 = planned(&p, &w, DType::F16, one);
        let (_, grid, block, smem, args) = kernel(&plan1, "pool_packed");
        assert_eq!((grid, block, smem), ((32, 1, 1), POOL_THREADS, 0));
        assert_eq!(
            args,
            &[
                Arg::Ptr(h),
                Arg::Ptr(Loc::Input(3 * 4096)),
                Arg::Ptr(Loc::Output(0)),
                Arg::I32(1024),
                Arg::I32(384),
                Arg::I32(pool_code(Pooling::Mean)),
                Arg::I32(1),
            ]
        );
        assert_eq!((plan1.counters, plan.output_elems), (0, 32 * 384));
        // Every layer's attention shares the one table.
        let (p2, w2) = packed_bert_dims(64, 64, 64, 384, 12, 1536);
        let plan2 = planned(
            &p2,
            &w2,
            DType::BF16,
            LIMITS.without(&KernelPath::SMALL_SHAPE),
        );
        assert_eq!(plan2.tile_tables.len(), 1);
        assert_eq!(plan2.tile_tables[0].max_tiles, 64);
        assert_eq!(
            kernel(&plan2, "attention_varlen_tc_bf16_d32").1,
            (64 * 12, 1, 1)
        );
    }

    #[test]
    fn kernels_can_be_switched_off() {
        let l = LIMITS.without(&[
            KernelPath::Skinny,
            KernelPath::TcAttention,
            KernelPath::GemmSmall,
        ]);
        assert!(!l.on(KernelPath::Skinny) && !l.on(KernelPath::TcAttention));
        assert!(l.on(KernelPath::LnVec) && l.on(KernelPath::EwVec));
        let (p, w) = tiny_bert(1, 16);
        let plan = planned(&p, &w, DType::F16, l);
        assert_eq!(plan.matmul_count(), 4);
        assert!(plan
            .steps
            .iter()
            .any(|s| matches!(s, Step::Kernel { name, .. } if name == "attention_f16_d32")));
    }

    #[test]
    fn bert_layer_plan() {
        let (p, w) = tiny_bert(2, 16);
        let plan = planned(&p, &w, DType::F16, LIMITS.without(&[KernelPath::GemmSmall]));
        assert_eq!(plan.matmul_count(), 4);
        // embed, attention, 2 add-LN, GELU, pool
        assert_eq!(plan.kernel_count(), 6);
        assert_eq!(
            plan.inputs.iter().map(|i| i.role).collect::<Vec<_>>(),
            vec![
                InputRole::TokenIds,
                InputRole::AttentionMask,
                InputRole::TokenTypeIds
            ]
        );
        let att = plan
            .steps
            .iter()
            .find_map(|s| match s {
                Step::Kernel {
                    name, grid, smem, ..
                } if name.starts_with("attention") => Some((name.clone(), *grid, *smem)),
                _ => None,
            })
            .unwrap();
        // At most 16 tokens: the 16-key-block kernel; longer sequences and
        // the switch keep the 64-key one (same grid and arguments).
        assert_eq!(att.0, "attention_tc_s16_f16_d32");
        assert_eq!(att.1, (1, 12, 2));
        assert_eq!(att.2, 0);
        let attention = |p: &Plan| {
            p.steps
                .iter()
                .find_map(|s| match s {
                    Step::Kernel { name, grid, .. } if name.starts_with("attention") => {
                        Some((name.clone(), *grid))
                    }
                    _ => None,
                })
                .unwrap()
        };
        let separate = LIMITS.without(&[KernelPath::GemmSmall]);
        let off = planned(&p, &w, DType::F16, separate.without(&[KernelPath::AttnS16]));
        assert_eq!(attention(&off), ("attention_tc_f16_d32".into(), (1, 12, 2)));
        let (p17, w17) = tiny_bert(2, 17);
        let long = planned(&p17, &w17, DType::F16, separate);
        assert_eq!(
            attention(&long),
            ("attention_tc_f16_d32".into(), (1, 12, 2))
        );
        // Long sequences: 128 queries a block (head size 32 from 512 tokens,
        // 64 from 128; 128 keeps 64-query blocks), unless switched off.
        let (p300, w300) = tiny_bert(2, 300);
        assert_eq!(
            attention(&planned(&p300, &w300, DType::F16, separate)),
            ("attention_tc_f16_d32".into(), (5, 12, 2))
        );
        let (p512, w512) = tiny_bert(2, 512);
        assert_eq!(
            attention(&planned(&p512, &w512, DType::F16, separate)),
            ("attention_tc_q128_f16_d32".into(), (4, 12, 2))
        );
        let no_q128 = separate.without(&[KernelPath::AttnQ128]);
        assert_eq!(
            attention(&planned(&p512, &w512, DType::BF16, no_q128)),
            ("attention_tc_bf16_d32".into(), (8, 12, 2))
        );
        let (pb, wb) = bert_dims(2, 128, 256, 2, 512);
        assert_eq!(
            attention(&planned(&pb, &wb, DType::F16, separate)),
            ("attention_tc_f16_d128".into(), (2, 2, 2))
        );
        // f32 keeps the CUDA-core kernel, with dynamic shared memory.
        let plan32 = planned(&p, &w, DType::F32, LIMITS);
        assert!(plan32
            .steps
            .iter()
            .any(|s| matches!(s, Step::Kernel { name, smem, .. }
            if name == "attention_f32_d32" && *smem as usize == attention_smem_bytes(16, 32))));
        match plan.steps.last().unwrap() {
            Step::Kernel { name, args, .. } => {
                assert_eq!(name, "pool_f16");
                assert_eq!(args[2], Arg::Ptr(Loc::Output(0)));
                assert_eq!(args[5], Arg::I32(0));
                assert_eq!(args[6], Arg::I32(1));
            }
            s => panic!("{s:?}"),
        }
    }

    /// Malformed programs are refused by validation before they reach the
    /// planner; what the planner refuses is what the device cannot run.
    #[test]
    fn malformed_programs_are_errors() {
        let (mut p, w) = mlp(2, Activation::Relu);
        if let Op::Linear(Linear { k, .. }) = &mut p.ops[0] {
            *k = 129;
        }
        let e = p.validate(&w).unwrap_err();
        assert!(e.to_string().contains("shape"), "{e}");

        let (mut p, w) = mlp(2, Activation::Relu);
        p.buffers[1].elems = 10; // activation too small
        assert!(p.validate(&w).is_err());

        let (p, w) = tiny_bert(1, 500);
        p.validate(&w).unwrap();
        let e = plan(&p, &w, DType::F32, false, Limits::new(48 * 1024)).unwrap_err();
        assert!(matches!(e, BackendError::Unsupported(_)), "{e:?}");

        let (mut p, w) = tiny_bert(1, 16);
        if let Op::Attention(Attention {
            qkv,
            seqs: Seqs::Padded { mask, .. },
            ..
        }) = &mut p.ops[2]
        {
            *mask = *qkv; // a float buffer as the mask
        }
        assert!(p.validate(&w).is_err());
        let (p, w) = tiny_bert(1, 16);
        assert!(plan(&p, &w, DType::I32, false, LIMITS).is_err());
    }

    /// The graphs the host-path targets are about (MiniLM, 6 layers): node
    /// counts before (the legacy kernels) and after the fusions.
    #[test]
    fn minilm_node_counts() {
        let (a, w) = minilm(6);
        let steps = |p: &Program, dtype: DType, limits: Limits| {
            p.validate(&w).unwrap();
            plan(p, &w, dtype, false, limits).unwrap()
        };
        let legacy = LIMITS.without(&KernelPath::SMALL_SHAPE);
        let default = LIMITS;
        // Nodes: before the small-shape kernels, and with every path on
        // (gemm_small at <= 32 padded or 64 packed rows).
        let cases = [
            ("(1, 16)", a.program(1, 16), 50, 32),
            ("(2, 32)", a.program(2, 32), 50, 50),
            ("(32, 128)", a.program(32, 128), 50, 50),
            ("(128, 128)", a.program(128, 128), 50, 50),
            ("64t", a.packed_program(64, 64), 50, 32),
            ("1024t", a.packed_program(1024, 256), 50, 50),
            ("16384t", a.packed_program(16384, 256), 50, 50),
            ("(1, 32)", a.program(1, 32), 50, 32),
        ];
        for (what, p, before, by_default) in &cases {
            assert_eq!(
                steps(p, DType::F16, legacy).node_count(),
                *before,
                "{what} legacy"
            );
            let now = steps(p, DType::F16, default);
            assert_eq!(
                now.node_count(),
                *by_default,
                "{what}: {:?}",
                now.step_names()
            );
            assert_eq!(now.node_count(), now.kernel_count() + now.matmul_count());
        }
        // By default (1, 16) is, per layer, QKV, attention, O + add, FFN1 +
        // GELU (normalising its input), FFN2 + add: no cuBLASLt, no separate
        // LayerNorm; the next layer's QKV normalises FFN2's rows, and the
        // pooling the last FFN2's.
        let gs = steps(&cases[0].1, DType::F16, default);
        let gemm = "gemm_small_f16";
        let mut want = layers_between(
            "embed_ln_vec_f16",
            6,
            &[gemm, "attention_tc_s16_f16_d32", gemm, gemm, gemm],
            "pool_ln_f16",
        );
        assert_eq!(gs.step_names(), want);
        assert_eq!((gs.matmul_count(), gs.counters), (0, 12));
        assert_eq!(gs.accum_bytes, 16 * 384 * 4);
        // (grid, act, mode, normalises its x) of each gemm_small.
        let gs_modes = |p: &Plan, steps: std::ops::Range<usize>| -> Vec<(u32, Arg, Arg, bool)> {
            p.steps[steps]
                .iter()
                .filter_map(|s| match s {
                    Step::Kernel {
                        name, grid, args, ..
                    } if name.starts_with("gemm_small") => {
                        Some((grid.0, args[7], args[8], args[17] != Arg::Null))
                    }
                    _ => None,
                })
                .collect()
        };
        let gelu = Arg::I32(act_code(Activation::Gelu));
        let (none, pre_norm, last_ln) = (Arg::I32(0), Arg::I32(2), Arg::I32(1));
        assert_eq!(
            gs_modes(&gs, 1..6),
            vec![
                (1152 / 16, none, none, false),    // QKV of the embedding's LN
                (384 / 16, none, pre_norm, false), // O + residual, pre-norm
                (1536 / 16, gelu, none, true),     // LN, FFN1 + GELU
                (384 / 16, none, pre_norm, false), // FFN2 + residual, pre-norm
            ]
        );
        assert_eq!(gs_modes(&gs, 6..11)[0], (1152 / 16, none, none, true));
        assert_eq!(gs_modes(&gs, 26..31)[3], (384 / 16, none, pre_norm, false));
        let (Step::Kernel { args: ffn2, .. }, Step::Kernel { args: pool, .. }) =
            (&gs.steps[30], &gs.steps[31])
        else {
            panic!("kernels")
        };
        assert_eq!(pool[0], ffn2[10], "the pooling reads the pre-norm rows");
        assert_eq!(pool.len(), 7 + 3 + 1);
        assert_eq!(pool[10], Arg::I32(1), "out_rows: the whole batch");
        // A deferred LayerNorm: the f32 scratch its producer wrote, its
        // gamma, beta and eps, and the buffer the consumer's block 0 fills.
        let (Step::Kernel { args: o, .. }, Step::Kernel { args: f1, .. }) =
            (&gs.steps[3], &gs.steps[4])
        else {
            panic!("kernels")
        };
        assert_eq!(f1[17], o[10]);
        assert!(matches!(f1[18], Arg::Ptr(Loc::Weight(_))));
        assert!(matches!(f1[20], Arg::F32(e) if e > 0.0));
        assert_eq!(f1[21], o[3], "the LayerNorm's output buffer");
        // Switched off: every add + LN in its own kernel's last block again.
        let apart = steps(
            &cases[0].1,
            DType::F16,
            default.without(&[KernelPath::LnDefer]),
        );
        want[31] = "pool_f16".into();
        assert_eq!(apart.step_names(), want);
        assert_eq!(
            gs_modes(&apart, 26..31)[3],
            (384 / 16, none, last_ln, false)
        );
        assert!(gs_modes(&apart, 0..32)
            .iter()
            .all(|m| !m.3 && m.2 != pre_norm));
        // Every kernel after the first follows a kernel: all launch
        // programmatically; none with the switch off.
        assert!(!gs.programmatic(0) && (1..32).all(|i| gs.programmatic(i)));
        let no_pdl = steps(&cases[0].1, DType::F16, default.without(&[KernelPath::Pdl]));
        assert!((0..32).all(|i| !no_pdl.programmatic(i)));
        // With cuBLASLt, only the kernels after kernels.
        let big = steps(&cases[3].1, DType::F16, default);
        let after_kernel: Vec<usize> = (0..50).filter(|&i| big.programmatic(i)).collect();
        // per layer: add_ln after mm, bias_act after mm, add_ln after mm:
        // none; attention after mm: none; the pooling after the last LN.
        assert_eq!(after_kernel, vec![49], "{:?}", big.step_names());
        // The packed 64-token budget computes its live rows only.
        let p64 = steps(&cases[4].1, DType::F16, default);
        assert!(p64.steps.iter().all(|s| match s {
            Step::Kernel { name, args, .. } if name.starts_with("gemm_small") =>
                matches!(args[15], Arg::Ptr(_)) && args[16] == Arg::I32(64),
            _ => true,
        }));
        assert!(gs.steps.iter().all(|s| match s {
            Step::Kernel { name, args, .. } if name.starts_with("gemm_small") =>
                args[15] == Arg::Null,
            _ => true,
        }));
        // (128, 128): cuBLASLt, with the vectorised LayerNorms and GELU,
        // the 64-query attention (head size 32 takes 128 from 512 tokens).
        let big = steps(&cases[3].1, DType::F16, LIMITS);
        let layer: Vec<&str> = vec![
            "mm",
            "attention_tc_f16_d32",
            "mm",
            "add_ln_vec_f16",
            "mm",
            "bias_act_vec_f16",
            "mm",
            "add_ln_vec_f16",
        ];
        let names = big.step_names();
        assert_eq!(names[0], "embed_ln_vec_f16");
        assert_eq!(&names[1..9], &layer[..]);
        // The pooling over 16 blocks a sequence, a counter each.
        assert_eq!(names[49], "pool_split_f16");
        assert_eq!((big.counters, big.accum_bytes), (128, 0));
        let packed = steps(&cases[6].1, DType::F16, LIMITS).step_names();
        assert_eq!(packed[2], "attention_varlen_tc_f16_d32");
        assert_eq!(packed[6], "bias_act_vec_f16");
        // f32 keeps its matmuls (gemm_small is f16/bf16 only).
        let f32 = steps(&cases[0].1, DType::F32, LIMITS);
        assert_eq!((f32.node_count(), f32.matmul_count()), (50, 24));
        assert!(f32.step_names().contains(&"add_ln_vec_f32".to_string()));
        // bf16 takes gemm_small as f16 does.
        let bf = steps(&cases[0].1, DType::BF16, LIMITS);
        assert_eq!(bf.node_count(), 32);
        assert_eq!(bf.step_names()[1], "gemm_small_bf16");
    }

    /// Each kernel path, switched off alone, changes what MiniLM's small
    /// graphs run (the staged plan where the path is about staging); with
    /// every path off, (1, 16) plans the kernels of before them.
    #[test]
    fn every_switch_turns_off_its_path() {
        let (a, w) = minilm(1);
        let staged = |limits: Limits, program: &Program, dtype: DType| {
            let p = plan(program, &w, dtype, false, limits).unwrap();
            assert!(p.fits_staged_io());
            p.for_graph(&limits)
        };
        let (p16, p17, p64) = (a.program(1, 16), a.program(1, 17), a.packed_program(64, 64));
        let (p2x128, p2x512) = (a.program(2, 128), a.program(2, 512));
        let (mlp8, mw) = mlp(8, Activation::Relu);
        for path in KernelPath::ALL {
            let off = LIMITS.without(&[path]);
            assert_eq!(off.paths.off(), vec![path]);
            let changed = [
                (&p16, DType::F16),
                (&p16, DType::F32),
                (&p17, DType::F32),
                (&p64, DType::F16),
                (&p2x128, DType::F16), // pool_split
                (&p2x512, DType::F16), // attn_q128
            ]
            .iter()
            .any(|&(p, dtype)| staged(LIMITS, p, dtype) != staged(off, p, dtype))
                || plan(&mlp8, &mw, DType::F32, false, LIMITS)
                    != plan(&mlp8, &mw, DType::F32, false, off);
            assert!(changed, "{path}: no plan changes");
        }
        let all = LIMITS.without(&KernelPath::ALL);
        assert_eq!(all.max_dyn_smem, LIMITS.max_dyn_smem);
        let plan = planned(&p16, &w, DType::F16, all);
        assert_eq!(
            plan.step_names(),
            vec![
                "embed_ln_f16",
                "mm",
                "attention_f16_d32",
                "mm",
                "add_ln_f16",
                "mm",
                "bias_act_f16_f16",
                "mm",
                "add_ln_f16",
                "pool_f16"
            ]
        );
    }

    /// Every family folder plans for f32/f16/bf16, padded and packed, with
    /// the fused small-shape kernels and without, onto kernels the module
    /// has; each family's own ops become their own kernels.
    #[test]
    fn family_folders_plan_in_every_dtype_and_layout() {
        let entries: std::collections::HashSet<String> =
            crate::backend::cuda::kernels::expected_entry_points()
                .into_iter()
                .collect();
        for name in FAMILY_FOLDERS {
            let model = family_model(name);
            for (label, program) in family_programs(&model) {
                program
                    .validate(&model.weights)
                    .unwrap_or_else(|e| panic!("{name} {label}: {e}"));
                for op in &program.ops {
                    assert_eq!(not_on_cuda(op), None, "{name} {label}");
                }
                for dtype in [DType::F32, DType::F16, DType::BF16] {
                    for limits in [
                        LIMITS,
                        LIMITS.without(&KernelPath::SMALL_SHAPE),
                        LIMITS.without(&[KernelPath::TcAttention]),
                    ] {
                        let plan = plan(&program, &model.weights, dtype, false, limits)
                            .unwrap_or_else(|e| panic!("{name} {label} {dtype}: {e}"));
                        let steps = plan.step_names();
                        for s in &steps {
                            assert!(
                                s == "mm" || entries.contains(s),
                                "{name} {label} {dtype}: no kernel {s}"
                            );
                        }
                        let has = |prefix: &str| steps.iter().any(|s| s.starts_with(prefix));
                        let packed = program.is_packed();
                        let roberta = name.starts_with("xlmr") || name.starts_with("mpnet");
                        assert_eq!(
                            has(if packed {
                                "embed_ln_packed_padpos_"
                            } else {
                                "embed_ln_padpos_"
                            }),
                            roberta,
                            "{name} {label} {dtype}: {steps:?}"
                        );
                        let biased = steps.iter().filter(|s| s.contains("_bias_")).count();
                        let layers = match &model.arch {
                            crate::model::Architecture::Bert(a) => a.layers.len(),
                            _ => unreachable!(),
                        };
                        if name == "mpnet-st" {
                            // Every layer's attention has the bias.
                            assert_eq!(biased, layers, "{name} {label} {dtype}: {steps:?}");
                        } else {
                            assert_eq!(biased, 0, "{name} {label} {dtype}: {steps:?}");
                        }
                        if name == "bert-st-new" {
                            let pool = if packed {
                                "pool_packed_skip_"
                            } else {
                                "pool_skip_"
                            };
                            assert!(has(pool), "{name} {label}: {steps:?}");
                            // Normalize after the Dense, on the f32 output.
                            assert_eq!(steps.last().unwrap(), "l2norm_rows_f32", "{name} {label}");
                        } else {
                            assert!(!has("pool_skip") && !has("pool_packed_skip"));
                            assert!(!has("l2norm_rows"), "{name} {label}: {steps:?}");
                        }
                    }
                }
            }
        }
    }

    /// ModernBERT plans in every dtype and layout onto prenorm.cu's
    /// kernels (rotary, gated unit, LayerNorm without residual, windowed
    /// attention in its local layers only) and kernels the module has.
    #[test]
    fn modernbert_plans_onto_the_prenorm_kernels() {
        let entries: std::collections::HashSet<String> =
            crate::backend::cuda::kernels::expected_entry_points()
                .into_iter()
                .collect();
        let model = family_model("modernbert-st");
        for program in [
            model.program(2, 16),
            model
                .program_for(crate::bucket::Bucket::packed(64, 4))
                .unwrap(),
        ] {
            program.validate(&model.weights).unwrap();
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let plan = plan(&program, &model.weights, dtype, false, LIMITS).unwrap();
                let steps = plan.step_names();
                for s in &steps {
                    assert!(s == "mm" || entries.contains(s), "{dtype}: no kernel {s}");
                }
                let count = |prefix: &str| steps.iter().filter(|s| s.starts_with(prefix)).count();
                // Four layers: rotary in each, windows in the two local ones.
                assert_eq!(count("rotary_"), 4, "{steps:?}");
                assert_eq!(count("attention_window_"), 2, "{steps:?}");
                assert_eq!(count("gated_"), 4, "{steps:?}");
                assert_eq!(count("embed_rows_"), 1, "{steps:?}");
                // Embedding, three attention norms, four MLP norms, final.
                assert_eq!(count("ln_rows_"), 9, "{steps:?}");
            }
        }
    }

    /// The family kernels' arguments: the position-bias table and radius
    /// after the attention's own, the pad id after the embedding's, the
    /// skip input after the pooling mask or offsets, the row width of the
    /// normalisation.
    #[test]
    fn family_kernel_arguments() {
        let mpnet = family_model("mpnet-st");
        let crate::model::Architecture::Bert(arch) = &mpnet.arch else {
            unreachable!()
        };
        let bias = arch.position_bias.expect("MPNet has a position bias");
        let heads = arch.heads as i32;
        // The bias kernels' last two arguments: the table and the radius.
        let bias_args = [
            Arg::Ptr(Loc::Weight(bias.table)),
            Arg::I32(bias.radius as i32),
        ];
        for dtype in [DType::F32, DType::F16] {
            let ts = suffix(dtype);
            let p = mpnet.program(2, 64);
            let plan_ = plan(&p, &mpnet.weights, dtype, false, LIMITS).unwrap();
            // Head size 8: the CUDA-core kernels in every dtype.
            let (name, grid, _, _, args) = kernel(&plan_, "attention_bias_");
            assert_eq!(name, format!("attention_bias_{ts}_d32"));
            assert_eq!((grid.1, grid.2), (heads as u32, 2), "{name}");
            assert_eq!(args[args.len() - 2..], bias_args, "{name}");
            let (_, grid, _, _, args) = kernel(&plan_, "embed_ln_padpos_");
            assert_eq!(grid.0, 128);
            assert_eq!(args.len(), 15);
            assert_eq!(args[14], Arg::I32(1), "XLM-R / MPNet pad id");
            let pk = arch.packed_program(256, 8);
            let plan_ = plan(&pk, &mpnet.weights, dtype, false, LIMITS).unwrap();
            let (name, _, _, _, args) = kernel(&plan_, "attention_varlen_bias_");
            assert_eq!(args[args.len() - 2..], bias_args, "{name}");
            let (_, grid, _, _, args) = kernel(&plan_, "embed_ln_packed_padpos_");
            assert_eq!((grid.0, args.len(), args[14]), (256, 15, Arg::I32(1)));
        }
        // A kernel argument pointing at the input `buf`'s slot.
        let input_ptr = |plan: &Plan, buf: BufId| {
            let slot = plan.inputs.iter().find(|i| i.buf == buf).unwrap();
            Arg::Ptr(Loc::Input(slot.offset))
        };
        let st = family_model("bert-st-new");
        let p = st.program(4, 32);
        let skip = p
            .input(InputRole::PoolSkip)
            .expect("include_prompt = false");
        let plan_ = plan(&p, &st.weights, DType::F16, false, LIMITS).unwrap();
        let (_, grid, _, _, args) = kernel(&plan_, "pool_skip_f16");
        assert_eq!(grid.0, 4);
        assert_eq!((args.len(), args[2]), (8, input_ptr(&plan_, skip)));
        let (_, grid, block, _, args) = kernel(&plan_, "l2norm_rows_f32");
        assert_eq!((grid.0, block), (4, 32));
        assert_eq!(args[1], Arg::I32(24));
        let crate::model::Architecture::Bert(a) = &st.arch else {
            unreachable!()
        };
        let pk = a.packed_program(64, 4);
        let skip = pk.input(InputRole::PoolSkip).unwrap();
        let plan_ = plan(&pk, &st.weights, DType::BF16, false, LIMITS).unwrap();
        let (_, grid, _, _, args) = kernel(&plan_, "pool_packed_skip_bf16");
        assert_eq!(grid.0, 4);
        assert_eq!((args.len(), args[2]), (8, input_ptr(&plan_, skip)));
    }
}
