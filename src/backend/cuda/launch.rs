//! Issuing resolved steps on a stream: the same code for warm-up, capture
//! and the eager path, plus a per-step GPU profile.

use std::ffi::c_void;

use cudarc::driver::{result as dres, sys as dsys, CudaStream};

use super::error::DriverResultExt;
use super::matmul::Matmul;
use super::plan::suffix;
use super::resolve::{RArg, Resolved};
use crate::backend::BackendError;

/// Enqueues resolved steps on `stream` (no synchronisation). The caller has
/// made the context current on this thread.
pub fn enqueue(
    steps: &[Resolved],
    matmul: &Matmul,
    workspace: u64,
    workspace_bytes: usize,
    stream: &CudaStream,
) -> Result<(), BackendError> {
    for s in steps {
        enqueue_one(s, matmul, workspace, workspace_bytes, stream.cu_stream())?;
    }
    Ok(())
}

fn enqueue_one(
    s: &Resolved,
    matmul: &Matmul,
    workspace: u64,
    workspace_bytes: usize,
    stream: dsys::CUstream,
) -> Result<(), BackendError> {
    match s {
        Resolved::Kernel {
            func,
            grid,
            block,
            smem,
            args,
            pdl,
            ..
        } => {
            let mut ptrs = arg_ptrs(args);
            if !*pdl {
                // SAFETY: the planner checked every buffer extent against the
                // kernel's shape arguments; the argument list matches the
                // kernel's signature (see the `*_KERNEL` macros in kernels/).
                return unsafe {
                    dres::launch_kernel(*func, *grid, *block, *smem, stream, &mut ptrs)
                }
                .cu("kernel launch");
            }
            // SAFETY: an all-zero attribute value is valid (a plain int field).
            let mut attr: dsys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = dsys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: *smem,
                hStream: stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: as above; `config` and `attr` outlive the call.
            unsafe {
                dsys::cuLaunchKernelEx(&config, *func, ptrs.as_mut_ptr(), std::ptr::null_mut())
            }
            .result()
            .cu("kernel launch (programmatic)")
        }
        Resolved::Matmul {
            plan,
            w,
            x,
            residual,
            out,
        } => {
            // SAFETY: extents checked by the planner; the workspace belongs to this stream.
            unsafe {
                matmul.run(
                    plan,
                    *w,
                    *x,
                    *residual,
                    *out,
                    workspace,
                    workspace_bytes,
                    stream,
                )
            }
        }
    }
}

/// The kernel-parameter array of `args` (pointers to each value, valid
/// while `args` is).
pub fn arg_ptrs(args: &[RArg]) -> Vec<*mut c_void> {
    args.iter()
        .map(|a| match a {
            RArg::U64(v) => v as *const u64 as *mut c_void,
            RArg::I32(v) => v as *const i32 as *mut c_void,
            RArg::I64(v) => v as *const i64 as *mut c_void,
            RArg::F32(v) => v as *const f32 as *mut c_void,
            RArg::Inline(b) => b.as_ptr() as *mut c_void,
        })
        .collect()
}

/// A short name for a step (profiles, logs).
pub fn label(s: &Resolved) -> String {
    match s {
        Resolved::Kernel { name, grid, .. } => {
            format!("{name} grid {}x{}x{}", grid.0, grid.1, grid.2)
        }
        Resolved::Matmul { plan, .. } => {
            let sh = plan.shape;
            format!(
                "cublasLt {} m{} n{} k{} {:?}{}",
                suffix(sh.dtype),
                sh.m,
                sh.n,
                sh.k,
                sh.epilogue,
                if sh.accumulate { "+C" } else { "" }
            )
        }
    }
}

/// Runs the steps `reps` times with an event after every step and returns
/// each step's mean GPU time in microseconds (steps queued back to back, so
/// the time between events is the step's own).
pub fn profile(
    steps: &[Resolved],
    matmul: &Matmul,
    workspace: u64,
    workspace_bytes: usize,
    stream: &CudaStream,
    reps: usize,
) -> Result<Vec<(String, f64)>, BackendError> {
    let cs = stream.cu_stream();
    let ev = super::timing::Events::new(steps.len() + 1).cu("cuEventCreate")?;
    let mut total = vec![0f64; steps.len()];
    // One untimed pass first.
    enqueue(steps, matmul, workspace, workspace_bytes, stream)?;
    for _ in 0..reps.max(1) {
        // SAFETY: `cs` is the live stream borrowed above.
        unsafe { ev.record(0, cs) }.cu("cuEventRecord")?;
        for (i, s) in steps.iter().enumerate() {
            enqueue_one(s, matmul, workspace, workspace_bytes, cs)?;
            // SAFETY: as above.
            unsafe { ev.record(i + 1, cs) }.cu("cuEventRecord")?;
        }
        for (i, t) in total.iter_mut().enumerate() {
            *t += ev.elapsed_ms(i, i + 1).cu("cuEventElapsedTime")? as f64 * 1e3;
        }
    }
    Ok(steps
        .iter()
        .zip(total)
        .map(|(s, t)| (label(s), t / reps.max(1) as f64))
        .collect())
}
