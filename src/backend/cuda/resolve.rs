//! Resolving a [`Plan`]'s symbolic locations ([`Loc`]) into device
//! addresses, with each matmul's cuBLASLt plan.

use std::sync::Arc;

use cudarc::driver::{sys as dsys, CudaStream};

use super::kernels::Kernels;
use super::matmul::{Epilogue, Matmul, MatmulPlan, MatmulShape, TuneArgs};
use super::plan::{act_code, ew_blocks, suffix, Arg, Loc, Plan, Step, EW_THREADS, INLINE_WORDS};
use crate::backend::BackendError;

/// Base addresses for resolving [`Loc`]s.
pub struct Bases<'a> {
    pub weights: &'a [u64],
    pub inputs: u64,
    pub output: u64,
    pub arena: u64,
    /// [`MAX_COUNTERS`](super::plan::MAX_COUNTERS) zeroed u32s owned by the stream that runs the plan
    /// (`plan::COUNTER_BLOCK_BYTES`).
    pub counters: u64,
    /// The device addresses of a pinned slot's input block and output, for
    /// a staged plan's [`Loc::StagedInput`] / [`Loc::StagedOutput`] (0 for
    /// plans without staging, which never name them).
    pub staged: (u64, u64),
}

impl Bases<'_> {
    fn addr(&self, l: Loc) -> u64 {
        match l {
            Loc::Weight(w) => self.weights[w.0],
            Loc::Input(o) => self.inputs + o as u64,
            Loc::Output(o) => self.output + o as u64,
            Loc::Arena(o) => self.arena + o as u64,
            Loc::Counter(i) => self.counters + 4 * i as u64,
            Loc::StagedInput(o) => self.staged.0 + o as u64,
            Loc::StagedOutput(o) => self.staged.1 + o as u64,
        }
    }
}

/// A kernel argument with its value.
#[derive(Clone, Debug, PartialEq)]
pub enum RArg {
    U64(u64),
    I32(i32),
    I64(i64),
    /// An input block by value ([`Arg::Inline`]).
    Inline(Box<[u32; INLINE_WORDS]>),
    F32(f32),
}

/// A step with device addresses, ready to enqueue.
pub enum Resolved {
    Kernel {
        name: String,
        func: dsys::CUfunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: Vec<RArg>,
        /// Launched with programmatic dependent launch (see `Plan::pdl`).
        pdl: bool,
    },
    Matmul {
        plan: Arc<MatmulPlan>,
        w: u64,
        x: u64,
        /// C of an accumulating plan (0 otherwise).
        residual: u64,
        out: u64,
    },
}

/// A kernel step's arguments with their values.
pub fn resolve_args(args: &[Arg], bases: &Bases<'_>) -> Vec<RArg> {
    args.iter()
        .map(|a| match *a {
            Arg::Ptr(l) => RArg::U64(bases.addr(l)),
            Arg::Null => RArg::U64(0),
            Arg::I32(v) => RArg::I32(v),
            Arg::I64(v) => RArg::I64(v),
            Arg::F32(v) => RArg::F32(v),
            Arg::Inline => RArg::Inline(Box::new([0; INLINE_WORDS])),
        })
        .collect()
}

/// Resolves a plan's steps against base addresses; matmul plans come from
/// (and are cached in) `matmul`.
///
/// With `tune` (the stream's workspace address and the stream, outside any
/// capture), matmul algorithms are chosen by timing on the plan's buffers.
pub fn resolve(
    plan: &Plan,
    bases: &Bases<'_>,
    kernels: &Kernels,
    matmul: &mut Matmul,
    workspace_bytes: usize,
    tune: Option<(u64, &CudaStream)>,
) -> Result<Vec<Resolved>, BackendError> {
    let mut out_steps = Vec::with_capacity(plan.steps.len());
    for (i, s) in plan.steps.iter().enumerate() {
        let step = match s {
            Step::Kernel {
                name,
                grid,
                block,
                smem,
                args,
            } => {
                let f = kernels
                    .get(name)
                    .ok_or_else(|| BackendError::Other(format!("kernel {name} is not loaded")))?;
                Resolved::Kernel {
                    pdl: plan.programmatic(i),
                    name: name.clone(),
                    func: f.cu_function(),
                    grid: *grid,
                    block: *block,
                    smem: *smem,
                    args: resolve_args(args, bases),
                }
            }
            Step::Matmul {
                shape,
                w,
                x,
                out,
                bias,
                residual,
            } => {
                let bias_addr = bias.map(|b| bases.addr(b));
                let residual = residual.map_or(0, |r| bases.addr(r));
                let tune_args = tune.map(|(ws, stream)| TuneArgs {
                    w: bases.addr(*w),
                    x: bases.addr(*x),
                    d: bases.addr(*out),
                    workspace: ws,
                    stream: stream.cu_stream(),
                });
                match matmul.plan(*shape, bias_addr, workspace_bytes, tune_args) {
                    Ok(p) => Resolved::Matmul {
                        plan: p,
                        w: bases.addr(*w),
                        x: bases.addr(*x),
                        residual,
                        out: bases.addr(*out),
                    },
                    // No algorithm for this epilogue: plain matmul, then bias
                    // and activation in our element-wise kernel.
                    Err(BackendError::Unsupported(why)) if shape.epilogue != Epilogue::None => {
                        tracing::debug!(
                            target: "replayd::cuda",
                            "cuBLASLt epilogue {:?} unavailable for {}x{}x{} ({why}); using a separate kernel",
                            shape.epilogue,
                            shape.m,
                            shape.n,
                            shape.k
                        );
                        let plain = MatmulShape {
                            epilogue: Epilogue::None,
                            ..*shape
                        };
                        out_steps.push(Resolved::Matmul {
                            plan: matmul.plan(plain, None, workspace_bytes, tune_args)?,
                            w: bases.addr(*w),
                            x: bases.addr(*x),
                            residual,
                            out: bases.addr(*out),
                        });
                        let name = format!("bias_act_{0}_{0}", suffix(shape.dtype));
                        let f = kernels.get(&name).ok_or_else(|| {
                            BackendError::Other(format!("kernel {name} is not loaded"))
                        })?;
                        let n = shape.m * shape.n;
                        let o = bases.addr(*out);
                        Resolved::Kernel {
                            pdl: false,
                            name,
                            func: f.cu_function(),
                            grid: (ew_blocks(n), 1, 1),
                            block: (EW_THREADS, 1, 1),
                            smem: 0,
                            args: vec![
                                RArg::U64(o),
                                RArg::U64(bias_addr.unwrap_or(0)),
                                RArg::U64(o),
                                RArg::I32(n as i32),
                                RArg::I32(shape.n as i32),
                                RArg::I32(act_code(shape.epilogue.activation())),
                            ],
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        out_steps.push(step);
    }
    Ok(out_steps)
}
