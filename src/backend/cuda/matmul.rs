//! Linear layers through cuBLASLt, with fused epilogues.
//!
//! Row-major `out[m, n] = act(x[m, k] · wᵀ + bias)` with `w` stored `[n, k]`
//! (PyTorch's layout) is, in cuBLASLt's column-major terms,
//! `D(n × m) = op_T(A)(n × k) · B(k × m)` with `A = w` seen as a `k × n`
//! matrix (ld k, transposed), `B = x` seen as `k × m` (ld k) and `D = out`
//! seen as `n × m` (ld n). The bias is per row of `D`, i.e. per output feature.
//!
//! * f32 models compute in true f32 (`CUBLAS_COMPUTE_32F`) unless
//!   `allow_tf32`, then `CUBLAS_COMPUTE_32F_FAST_TF32`; f16/bf16 models use
//!   f16/bf16 operands with f32 accumulation and scale.
//! * The workspace is ours (passed to every call), so cuBLASLt never allocates
//!   and captured graphs hold no allocation nodes. One workspace per stream.
//! * cuBLASLt's `GELU` epilogue is the tanh approximation: it is used only for
//!   [`Activation::GeluTanh`]; exact GELU and the other activations run in a
//!   separate kernel after a `BIAS` (or no) epilogue.
//!
//! The heuristic's algorithm is cached per shape; a plan (descriptors with
//! the bias pointer baked in, immutable afterwards) per (shape, bias).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::error::CublasResultExt;
use crate::backend::BackendError;
use crate::model::Activation;
use crate::tensor::DType;

/// cuBLASLt epilogues we use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    None,
    Bias,
    Relu,
    ReluBias,
    GeluTanh,
    GeluTanhBias,
}

impl Epilogue {
    fn raw(self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t::*;
        match self {
            Epilogue::None => CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => CUBLASLT_EPILOGUE_BIAS,
            Epilogue::Relu => CUBLASLT_EPILOGUE_RELU,
            Epilogue::ReluBias => CUBLASLT_EPILOGUE_RELU_BIAS,
            Epilogue::GeluTanh => CUBLASLT_EPILOGUE_GELU,
            Epilogue::GeluTanhBias => CUBLASLT_EPILOGUE_GELU_BIAS,
        }
    }

    /// The activation the epilogue applies.
    pub fn activation(self) -> Activation {
        match self {
            Epilogue::None | Epilogue::Bias => Activation::Identity,
            Epilogue::Relu | Epilogue::ReluBias => Activation::Relu,
            Epilogue::GeluTanh | Epilogue::GeluTanhBias => Activation::GeluTanh,
        }
    }

    pub fn has_bias(self) -> bool {
        matches!(
            self,
            Epilogue::Bias | Epilogue::ReluBias | Epilogue::GeluTanhBias
        )
    }
}

/// How a linear layer maps onto cuBLASLt: the epilogue, and the activation
/// (if any) that a separate kernel must still apply.
pub fn split_activation(act: Activation, has_bias: bool) -> (Epilogue, Option<Activation>) {
    match (act, has_bias) {
        (Activation::Identity, false) => (Epilogue::None, None),
        (Activation::Identity, true) => (Epilogue::Bias, None),
        (Activation::Relu, false) => (Epilogue::Relu, None),
        (Activation::Relu, true) => (Epilogue::ReluBias, None),
        (Activation::GeluTanh, false) => (Epilogue::GeluTanh, None),
        (Activation::GeluTanh, true) => (Epilogue::GeluTanhBias, None),
        (other, false) => (Epilogue::None, Some(other)),
        (other, true) => (Epilogue::Bias, Some(other)),
    }
}

/// The shape and types of one matmul (the plan cache key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatmulShape {
    /// Operand and output storage type.
    pub dtype: DType,
    /// Rows of `x` and `out`.
    pub m: usize,
    /// Output features.
    pub n: usize,
    /// Input features.
    pub k: usize,
    pub epilogue: Epilogue,
    /// f32 only: TF32 tensor cores.
    pub tf32: bool,
    /// `out = product + epilogue + c` (cuBLASLt's C, β = 1; C has D's
    /// layout): the residual of the AddLayerNorm that follows, added here
    /// so that the LayerNorm reads one operand instead of two.
    pub accumulate: bool,
}

fn data_type(d: DType) -> Result<sys::cudaDataType_t, BackendError> {
    Ok(match d {
        DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
        DType::F16 => sys::cudaDataType_t::CUDA_R_16F,
        DType::BF16 => sys::cudaDataType_t::CUDA_R_16BF,
        other => {
            return Err(BackendError::Unsupported(format!(
                "cuBLASLt matmul in {other}"
            )))
        }
    })
}

/// Compute type for a storage type.
pub fn compute_type(d: DType, tf32: bool) -> sys::cublasComputeType_t {
    match (d, tf32) {
        (DType::F32, true) => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}

/// Descriptors and the chosen algorithm for one [`MatmulShape`] and bias
/// pointer. Never modified after creation.
pub struct MatmulPlan {
    pub shape: MatmulShape,
    pub bias: Option<u64>,
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// Workspace the algorithm needs (≤ the workspace it was planned for).
    pub workspace_bytes: usize,
}

// SAFETY: the descriptors are host-side objects that are only read after
// creation; cuBLASLt allows using them from any thread.
unsafe impl Send for MatmulPlan {}
unsafe impl Sync for MatmulPlan {}

impl Drop for MatmulPlan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once by this plan; errors ignored.
        unsafe {
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
            for l in [self.a, self.b, self.d] {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
        }
    }
}

struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created once; errors ignored.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// A cuBLASLt handle with its plan cache. Destroyed on drop (errors ignored).
pub struct Matmul {
    handle: sys::cublasLtHandle_t,
    /// (algorithm, its workspace, whether it was chosen by timing).
    algos: HashMap<(MatmulShape, usize), (sys::cublasLtMatmulAlgo_t, usize, bool)>,
    plans: HashMap<(MatmulShape, Option<u64>, usize, bool), Arc<MatmulPlan>>,
}

// SAFETY: a cuBLASLt handle may be used from any thread (calls are serialised
// by `&mut self` / the owner).
unsafe impl Send for Matmul {}

/// Plans kept before the cache is cleared (eager shapes vary without bound).
const MAX_PLANS: usize = 8192;

/// Algorithms the heuristic proposes for autotuning.
const TUNE_CANDIDATES: usize = 8;

/// Buffers and stream to time candidate algorithms on (outside any capture;
/// the output is overwritten).
#[derive(Clone, Copy, Debug)]
pub struct TuneArgs {
    pub w: u64,
    pub x: u64,
    pub d: u64,
    pub workspace: u64,
    pub stream: cudarc::driver::sys::CUstream,
}

impl Matmul {
    /// Creates the handle. cuBLASLt must be loadable (see `libs`).
    pub fn new() -> Result<Matmul, BackendError> {
        let handle = lt::create_handle().lt("cublasLtCreate")?;
        Ok(Matmul {
            handle,
            algos: HashMap::new(),
            plans: HashMap::new(),
        })
    }

    /// The plan for `shape` and `bias` using at most `workspace_bytes` of workspace.
    /// With `tune`, the first plan of a shape times the heuristic's candidate
    /// algorithms on those buffers and keeps the fastest; otherwise the
    /// heuristic's first choice is used.
    pub fn plan(
        &mut self,
        shape: MatmulShape,
        bias: Option<u64>,
        workspace_bytes: usize,
        tune: Option<TuneArgs>,
    ) -> Result<Arc<MatmulPlan>, BackendError> {
        if shape.epilogue.has_bias() != bias.is_some() {
            return Err(BackendError::Other(format!(
                "matmul epilogue {:?} with bias {bias:?}",
                shape.epilogue
            )));
        }
        let key = (shape, bias, workspace_bytes, tune.is_some());
        if let Some(p) = self.plans.get(&key) {
            return Ok(p.clone());
        }
        if self.plans.len() >= MAX_PLANS {
            self.plans.clear();
        }
        let p = Arc::new(self.make_plan(shape, bias, workspace_bytes, tune)?);
        self.plans.insert(key, p.clone());
        Ok(p)
    }

    /// Number of cached plans (for logs and tests).
    pub fn cached_plans(&self) -> usize {
        self.plans.len()
    }

    fn make_plan(
        &mut self,
        shape: MatmulShape,
        bias: Option<u64>,
        workspace_bytes: usize,
        tune: Option<TuneArgs>,
    ) -> Result<MatmulPlan, BackendError> {
        let dt = data_type(shape.dtype)?;
        let (m, n, k) = (shape.m as u64, shape.n as u64, shape.k as u64);
        let mut plan = MatmulPlan {
            shape,
            bias,
            desc: std::ptr::null_mut(),
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            // SAFETY: plain-old-data, overwritten by the heuristic below.
            algo: unsafe { std::mem::zeroed() },
            workspace_bytes: 0,
        };
        plan.desc = lt::create_matmul_desc(
            compute_type(shape.dtype, shape.tf32),
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .lt("cublasLtMatmulDescCreate")?;
        let set = |attr: sys::cublasLtMatmulDescAttributes_t, v: *const c_void, size: usize| {
            // SAFETY: the descriptor is live; `v` points at `size` bytes.
            unsafe { lt::set_matmul_desc_attribute(plan.desc, attr, v, size) }
                .lt("cublasLtMatmulDescSetAttribute")
        };
        let trans_t: i32 = 1; // CUBLAS_OP_T
        let trans_n: i32 = 0;
        set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            &trans_t as *const i32 as *const c_void,
            4,
        )?;
        set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            &trans_n as *const i32 as *const c_void,
            4,
        )?;
        let epi = shape.epilogue.raw();
        set(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &epi as *const sys::cublasLtEpilogue_t as *const c_void,
            std::mem::size_of::<sys::cublasLtEpilogue_t>(),
        )?;
        if let Some(b) = bias {
            set(
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &b as *const u64 as *const c_void,
                8,
            )?;
        }
        plan.a =
            lt::create_matrix_layout(dt, k, n, k as i64).lt("cublasLtMatrixLayoutCreate(A)")?;
        plan.b =
            lt::create_matrix_layout(dt, k, m, k as i64).lt("cublasLtMatrixLayoutCreate(B)")?;
        plan.d =
            lt::create_matrix_layout(dt, n, m, n as i64).lt("cublasLtMatrixLayoutCreate(D)")?;

        if let Some(&(algo, ws, _)) = self
            .algos
            .get(&(shape, workspace_bytes))
            .filter(|a| a.2 || tune.is_none())
        {
            plan.algo = algo;
            plan.workspace_bytes = ws;
            return Ok(plan);
        }
        let pref = Pref(lt::create_matmul_pref().lt("cublasLtMatmulPreferenceCreate")?);
        // SAFETY: live preference, value of the documented type (u64).
        unsafe {
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &(workspace_bytes as u64) as *const u64 as *const c_void,
                8,
            )
        }
        .lt("cublasLtMatmulPreferenceSetAttribute")?;
        let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> =
            // SAFETY: plain-old-data, filled in by cuBLASLt.
            vec![unsafe { std::mem::zeroed() }; TUNE_CANDIDATES];
        let mut count: i32 = 0;
        let what = || {
            format!(
                "cublasLtMatmulAlgoGetHeuristic for {:?} {}x{}x{} {:?}{}",
                shape.dtype,
                shape.m,
                shape.n,
                shape.k,
                shape.epilogue,
                if shape.accumulate { " + C" } else { "" }
            )
        };
        // SAFETY: all handles are live; `results` holds TUNE_CANDIDATES entries.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                plan.desc,
                plan.a,
                plan.b,
                plan.d,
                plan.d,
                pref.0,
                if tune.is_some() {
                    TUNE_CANDIDATES as i32
                } else {
                    1
                },
                results.as_mut_ptr(),
                &mut count,
            )
        }
        .result()
        .map_err(|e| super::error::cublas_error(&what(), e))?;
        let candidates: Vec<&sys::cublasLtMatmulHeuristicResult_t> = results
            .iter()
            .take(count.max(0) as usize)
            .filter(|r| {
                r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                    && r.workspaceSize <= workspace_bytes
            })
            .collect();
        let Some(first) = candidates.first() else {
            return Err(BackendError::Unsupported(format!(
                "{}: no algorithm",
                what()
            )));
        };
        let mut best = (first.algo, first.workspaceSize);
        if let (Some(t), true) = (tune, candidates.len() > 1) {
            let mut best_ms = f32::INFINITY;
            for c in &candidates {
                plan.algo = c.algo;
                plan.workspace_bytes = c.workspaceSize;
                // SAFETY: the caller's buffers fit the shape; outside any capture.
                if let Ok(ms) = unsafe { self.time_plan(&plan, &t, workspace_bytes) } {
                    if ms < best_ms {
                        best_ms = ms;
                        best = (c.algo, c.workspaceSize);
                    }
                }
            }
            tracing::debug!(
                target: "replayd::cuda",
                "tuned {:?} {}x{}x{} {:?}: {} candidates, best {:.1} us",
                shape.dtype,
                shape.m,
                shape.n,
                shape.k,
                shape.epilogue,
                candidates.len(),
                best_ms * 1e3
            );
        }
        plan.algo = best.0;
        plan.workspace_bytes = best.1;
        self.algos
            .insert((shape, workspace_bytes), (best.0, best.1, tune.is_some()));
        Ok(plan)
    }

    /// Enqueues `d = epilogue(w · x + bias)` on `stream` (see the module docs
    /// for the layout), plus `c` where the shape accumulates (`c` is
    /// ignored otherwise). Pointers are device addresses, 256-byte aligned.
    ///
    /// # Safety
    /// The pointers (and the plan's bias) must be valid for the plan's shape
    /// and type, `workspace` must hold at least `plan.workspace_bytes`, and
    /// nothing else may use that workspace concurrently.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        plan: &MatmulPlan,
        w: u64,
        x: u64,
        c: u64,
        d: u64,
        workspace: u64,
        workspace_bytes: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), BackendError> {
        let alpha: f32 = 1.0;
        let (beta, c): (f32, u64) = if plan.shape.accumulate {
            (1.0, c)
        } else {
            (0.0, d)
        };
        lt::matmul(
            self.handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            w as *const c_void,
            plan.a,
            x as *const c_void,
            plan.b,
            c as *const c_void,
            plan.d,
            d as *mut c_void,
            plan.d,
            &plan.algo,
            workspace as *mut c_void,
            workspace_bytes,
            stream as sys::cudaStream_t,
        )
        .lt("cublasLtMatmul")
    }
}

impl Matmul {
    /// Median-free quick timing of one plan: one warm-up run, then the mean of
    /// a few runs, in milliseconds.
    ///
    /// # Safety
    /// As for [`Matmul::run`]; not during a capture.
    unsafe fn time_plan(
        &self,
        plan: &MatmulPlan,
        t: &TuneArgs,
        workspace_bytes: usize,
    ) -> Result<f32, BackendError> {
        use super::error::DriverResultExt;
        const RUNS: usize = 5;
        let ev = super::timing::Events::new(2).cu("cuEventCreate")?;
        // (An accumulating plan adds the output to itself: timing only.)
        self.run(
            plan,
            t.w,
            t.x,
            t.d,
            t.d,
            t.workspace,
            workspace_bytes,
            t.stream,
        )?;
        ev.record(0, t.stream).cu("cuEventRecord")?;
        for _ in 0..RUNS {
            self.run(
                plan,
                t.w,
                t.x,
                t.d,
                t.d,
                t.workspace,
                workspace_bytes,
                t.stream,
            )?;
        }
        ev.record(1, t.stream).cu("cuEventRecord")?;
        Ok(ev.elapsed_ms(0, 1).cu("cuEventElapsedTime")? / RUNS as f32)
    }
}

impl Drop for Matmul {
    fn drop(&mut self) {
        self.plans.clear();
        self.algos.clear();
        if !self.handle.is_null() {
            // SAFETY: created once; errors ignored (cudarc's own wrapper unwraps here).
            let _ = unsafe { lt::destroy_handle(self.handle) };
        }
    }
}

/// The workspace size NVIDIA recommends: 32 MiB on Hopper and newer, 4 MiB before.
pub fn workspace_bytes_for(cc_major: u32) -> usize {
    if cc_major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_split_into_epilogues() {
        use Activation::*;
        assert_eq!(split_activation(Identity, true), (Epilogue::Bias, None));
        assert_eq!(split_activation(Identity, false), (Epilogue::None, None));
        assert_eq!(split_activation(Relu, true), (Epilogue::ReluBias, None));
        assert_eq!(
            split_activation(GeluTanh, true),
            (Epilogue::GeluTanhBias, None)
        );
        // cuBLASLt's GELU is the tanh approximation: exact GELU is never fused.
        assert_eq!(split_activation(Gelu, true), (Epilogue::Bias, Some(Gelu)));
        assert_eq!(split_activation(Gelu, false), (Epilogue::None, Some(Gelu)));
        assert_eq!(split_activation(Silu, true), (Epilogue::Bias, Some(Silu)));
        assert!(Epilogue::GeluTanhBias.has_bias() && !Epilogue::Relu.has_bias());
    }

    #[test]
    fn compute_types() {
        use sys::cublasComputeType_t::*;
        assert_eq!(compute_type(DType::F32, false), CUBLAS_COMPUTE_32F);
        assert_eq!(compute_type(DType::F32, true), CUBLAS_COMPUTE_32F_FAST_TF32);
        assert_eq!(compute_type(DType::F16, true), CUBLAS_COMPUTE_32F);
        assert_eq!(workspace_bytes_for(9), 32 << 20);
        assert_eq!(workspace_bytes_for(8), 4 << 20);
    }
}
