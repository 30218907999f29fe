//! The CUDA backend: NVRTC-compiled kernels (`kernels/`), cuBLASLt matmuls
//! with fused epilogues, and one CUDA graph per bucket: a padded (batch, seq)
//! rectangle, or a packed token budget whose static inputs (ids, types,
//! positions, `cu_seqlens` and the varlen attention's tile table, see
//! [`plan`]) change contents per batch while the graph stays fixed.
//!
//! * [`kernels`]: NVRTC compile for the device's architecture + disk cache.
//! * [`matmul`]: cuBLASLt plans, our own workspace (no allocation in captures).
//! * [`plan`]: [`Program`] → launch plan (pure, tested without a GPU);
//!   [`resolve`]: the plan's locations → device addresses;
//!   [`launch`]: enqueue resolved steps (warm-up, capture, eager), profile.
//! * [`graph`]: captured graphs, the shared activation arena, pinned staging.
//! * [`error`]: CUDA/cuBLASLt errors → [`BackendError`] (sticky → `DeviceFault`).
//!
//! Finding the CUDA libraries and NVML live in [`crate::gpu`], shared with
//! the daemon.
//!
//! Life cycle on a worker: [`CudaBackend::new`] (context, streams, kernels,
//! cuBLASLt handle and workspace) → `upload` per model (every weight in one
//! device buffer, copied as the checkpoint stores it when that is the
//! compute dtype, else converted piecewise on the way) → `capture` per bucket
//! (largest first: the first capture sizes the model's shared activation
//! arena) → `launch`/`collect` per batch. After a [`BackendError::DeviceFault`]
//! every call fails fast and dropping the backend touches no CUDA resource;
//! the worker is expected to exit.

pub mod error;
pub mod graph;
pub mod kernel_sources;
pub mod kernels;
pub mod launch;
pub mod matmul;
pub mod mem;
pub mod plan;
pub mod resolve;
pub mod timing;

use std::mem::ManuallyDrop;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as dres, sys, CudaContext, CudaStream};

use self::error::{driver_error, DriverResultExt};
use self::graph::{Arena, Slot, StagedIo};
pub use self::graph::{CapturedGraph, CudaPending, GraphMemory};
use self::kernels::{ImageOrigin, Kernels};
use self::matmul::Matmul;
use self::mem::{align_up, DeviceBuf};
use self::plan::{Limits, Plan};
use self::resolve::Bases;
use crate::backend::{Backend, BackendError, GraphNeed};
use crate::config::{KernelPath, KernelPaths};
use crate::gpu::libs::{self, CudaLib};
use crate::gpu::{cuda_device_count, format_uuid, DeviceInfo};
use crate::model::{BatchRows, Model, Program, Weights};
use crate::tensor::DType;

/// Options of the CUDA backend (the worker fills them from `[devices]`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CudaOptions {
    /// Let f32 matmuls use TF32 tensor cores (about 1e-3 relative error).
    pub allow_tf32: bool,
    /// Where compiled kernels are cached; `None`: the default
    /// ([`kernels::resolve_cache_dir`]).
    pub kernel_cache_dir: Option<PathBuf>,
    /// Time cuBLASLt's candidate algorithms at capture and keep the fastest,
    /// instead of taking its heuristic's first choice. Timing makes the
    /// choice (and the last bits of results) vary between GPUs and restarts.
    pub matmul_autotune: bool,
    /// The planner's kernel paths (`[devices] kernel_paths_off`).
    pub kernel_paths: KernelPaths,
}

/// The dynamic shared memory every dynamic-smem kernel may use: the opt-in
/// limit minus the largest static shared memory among them.
fn max_dyn_smem(k: &Kernels, optin: usize) -> usize {
    let static_max = k
        .iter()
        .filter(|(n, _)| kernels::needs_dynamic_smem(n))
        .filter_map(|(_, f)| f.shared_size_bytes().ok())
        .max()
        .unwrap_or(0)
        .max(0) as usize;
    optin.saturating_sub(static_max)
}

/// A model's weights on the device, converted to its compute dtype, plus the
/// activation arena its graphs share.
pub struct CudaWeights {
    buf: DeviceBuf,
    ptrs: Vec<u64>,
    dtype: DType,
    arena: Mutex<Option<Arc<Arena>>>,
}

impl CudaWeights {
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Device bytes of the weights.
    pub fn bytes(&self) -> u64 {
        self.buf.bytes() as u64
    }

    /// Bytes of the current shared activation arena (0 before the first capture).
    pub fn arena_bytes(&self) -> u64 {
        self.arena
            .lock()
            .ok()
            .and_then(|a| a.as_ref().map(|a| a.bytes() as u64))
            .unwrap_or(0)
    }
}

/// Buffers of the eager path, grown on demand and kept (own stream, so never
/// shared with the graphs).
#[derive(Default)]
struct EagerBuffers {
    workspace: Option<DeviceBuf>,
    counters: Option<DeviceBuf>,
    arena: Option<DeviceBuf>,
    io: Option<DeviceBuf>,
}

struct Inner {
    // Field order is drop order: everything that uses the context first.
    eager: EagerBuffers,
    workspace: DeviceBuf,
    /// Zeroed counters of the fused kernels on the graph stream.
    counters: DeviceBuf,
    matmul: Matmul,
    kernels: Kernels,
    eager_stream: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

/// The CUDA backend for one device. Lives on one thread of a worker process.
pub struct CudaBackend {
    inner: ManuallyDrop<Inner>,
    info: DeviceInfo,
    options: CudaOptions,
    limits: Limits,
    /// Set by the first sticky error; every later call fails with it.
    faulted: Option<String>,
    /// Staging slots allocated per graph at capture (more are added on demand).
    initial_slots: usize,
}

/// Staging slots each graph starts with (one running, one being filled).
pub const DEFAULT_STAGING_SLOTS: usize = 2;

/// The most host memory a weight upload stages at once: the pieces of the
/// weights it must convert to the compute dtype (those stored in it are
/// copied from where they lie).
const UPLOAD_STAGING_BYTES: usize = 64 << 20;

impl CudaBackend {
    /// Opens CUDA device `ordinal`: checks the libraries, creates the context
    /// (event tracking off, so nothing cudarc adds ends up in a capture), a
    /// high-priority stream for graphs and another for the eager path,
    /// compiles (or loads from the cache) the kernels, and creates the cuBLASLt
    /// handle and workspace.
    pub fn new(ordinal: usize, options: CudaOptions) -> Result<CudaBackend, BackendError> {
        Self::open(ordinal, options, &|_| {})
    }

    /// [`CudaBackend::new`], telling `on_compile` when the kernels must be
    /// compiled for this GPU (none built in or cached), before that starts.
    pub fn open(
        ordinal: usize,
        options: CudaOptions,
        on_compile: &dyn Fn(kernels::Target),
    ) -> Result<CudaBackend, BackendError> {
        // NVRTC only where the kernels must be compiled (kernels::load_for_device).
        libs::require(&[CudaLib::Driver, CudaLib::CublasLt]).map_err(BackendError::Unsupported)?;
        let count = cuda_device_count().map_err(BackendError::Unsupported)?;
        if ordinal >= count {
            return Err(BackendError::Unsupported(format!(
                "CUDA device {ordinal} requested, but {count} visible"
            )));
        }
        let ctx = CudaContext::new(ordinal).cu("CudaContext::new")?;
        // SAFETY: called before any buffer is allocated in this context.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx.compute_capability().cu("compute capability")?;
        let cc = (cc.0 as u32, cc.1 as u32);
        let name = ctx.name().cu("device name")?;
        let uuid = ctx.uuid().cu("device uuid")?;
        let uuid_bytes: [u8; 16] = std::array::from_fn(|i| uuid.bytes[i] as u8);
        let mut bus = [0 as std::ffi::c_char; 32];
        // SAFETY: 32-byte buffer, NUL-terminated by the driver.
        let pci = unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 32, ctx.cu_device()) }
            .result()
            .ok()
            .map(|_| {
                unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
                    .to_string_lossy()
                    .into_owned()
            });
        let total = ctx.total_mem().cu("total memory")?;
        let optin = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .cu("shared memory limit")?
            .max(48 * 1024) as usize;

        ctx.bind_to_thread().cu("bind context")?;
        let (least, greatest) = dres::stream::get_priority_range().cu("stream priorities")?;
        let stream = ctx.new_stream_with_priority(greatest).cu("create stream")?;
        let eager_stream = ctx
            .new_stream_with_priority(least)
            .cu("create eager stream")?;

        // Kernels: the embedded cubin → the cache → NVRTC.
        let who = format!("GPU {ordinal} ({name}, sm_{}{})", cc.0, cc.1);
        let cache_dir = options.kernel_cache_dir.as_deref();
        let kernels = kernels::load_for_device(&ctx, cc, cache_dir, &who, on_compile)?;
        for (name, f) in kernels.iter() {
            // The CUDA-core attention kernels size their shared memory by the
            // sequence length (dynamic); the others use static shared memory.
            if kernels::needs_dynamic_smem(name) {
                let static_smem = f.shared_size_bytes().cu("kernel shared memory")?.max(0) as usize;
                f.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    optin.saturating_sub(static_smem) as i32,
                )
                .cu("raise the attention kernel's shared memory limit")?;
            }
        }

        let matmul = Matmul::new()?;
        let workspace =
            DeviceBuf::zeroed(&ctx, matmul::workspace_bytes_for(cc.0)).cu("cuBLASLt workspace")?;
        let counters = DeviceBuf::zeroed(&ctx, plan::COUNTER_BLOCK_BYTES).cu("kernel counters")?;
        let mut limits = Limits::new(max_dyn_smem(&kernels, optin));
        limits.paths = options.kernel_paths;
        if !limits.paths.off().is_empty() {
            tracing::info!(
                target: "replayd::cuda",
                "kernel paths switched off ([devices] kernel_paths_off): {:?}",
                limits.paths.off()
            );
        }
        // griddepcontrol (programmatic dependent launch) is sm_90+.
        if cc.0 < 9 {
            limits = limits.without(&[KernelPath::Pdl]);
        }
        let info = DeviceInfo {
            backend: "cuda".into(),
            name,
            ordinal,
            pci_bus_id: pci,
            uuid: Some(format_uuid(&uuid_bytes)),
            compute_capability: Some(cc),
            memory_total_bytes: Some(total as u64),
        };
        Ok(CudaBackend {
            inner: ManuallyDrop::new(Inner {
                eager: EagerBuffers::default(),
                workspace,
                counters,
                matmul,
                kernels,
                eager_stream,
                stream,
                ctx,
            }),
            info,
            options,
            limits,
            faulted: None,
            initial_slots: DEFAULT_STAGING_SLOTS,
        })
    }

    /// The kernel paths the planner may take (the device's limits, less
    /// what `[devices] kernel_paths_off` switched off).
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// `program` planned for this device: the weights' dtype, the options'
    /// TF32 choice, the kernel paths on.
    fn plan_of(
        &self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
    ) -> Result<Plan, BackendError> {
        plan::plan(
            program,
            host,
            weights.dtype,
            self.options.allow_tf32,
            self.limits,
        )
    }

    /// Replaces the kernel paths for graphs captured and eager runs from
    /// now on (graphs captured before keep their plans): `backend-check`
    /// runs each bucket with the fused paths on and off.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    pub fn options(&self) -> &CudaOptions {
        &self.options
    }

    /// Where the kernels came from (cache file or NVRTC compile time).
    pub fn kernel_origin(&self) -> &ImageOrigin {
        &self.inner.kernels.origin
    }

    /// The cuBLASLt workspace of the graph stream, in bytes (shared by all graphs).
    pub fn workspace_bytes(&self) -> u64 {
        self.inner.workspace.bytes() as u64
    }

    /// The device fault that poisoned this backend, if any.
    pub fn fault(&self) -> Option<&str> {
        self.faulted.as_deref()
    }

    /// Staging slots a new graph gets (at least 1); more are added on demand.
    pub fn set_initial_staging_slots(&mut self, n: usize) {
        self.initial_slots = n.max(1);
    }

    /// Detailed device memory of a graph.
    pub fn graph_memory(&self, graph: &CapturedGraph) -> GraphMemory {
        graph.memory()
    }

    /// (free, total) device memory.
    pub fn mem_info(&mut self) -> Result<(usize, usize), BackendError> {
        self.alive()?;
        let r = self.inner.ctx.mem_get_info().cu("cuMemGetInfo");
        self.track(r)
    }

    /// Waits for everything on the graph stream.
    pub fn synchronize(&mut self) -> Result<(), BackendError> {
        self.alive()?;
        let r = self.inner.stream.synchronize().cu("stream synchronize");
        self.track(r)
    }

    /// Times the graph's replay alone, one at a time (launch, stream
    /// synchronised; no copies in or out, the device inputs of the last
    /// batch): µs per replay after `warmup` untimed ones. What a replay's
    /// copies cost is the backend check's launch → collect minus this.
    pub fn time_replay_only(
        &mut self,
        graph: &CapturedGraph,
        warmup: usize,
        iters: usize,
    ) -> Result<Vec<f64>, BackendError> {
        self.alive()?;
        let r = (|| {
            self.inner.ctx.bind_to_thread().cu("bind context")?;
            let mut samples = Vec::with_capacity(iters);
            for i in 0..warmup + iters {
                let t = std::time::Instant::now();
                graph.exec.launch().cu("cuGraphLaunch")?;
                self.inner.stream.synchronize().cu("stream synchronize")?;
                if i >= warmup {
                    samples.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            Ok(samples)
        })();
        self.track(r)
    }

    /// [`Backend::upload`] for a bare weight table in compute type `dtype`.
    pub fn upload_weights(
        &mut self,
        host: &Weights,
        dtype: DType,
    ) -> Result<CudaWeights, BackendError> {
        self.alive()?;
        let r = self.upload_inner(host, dtype);
        self.track(r)
    }

    /// [`Backend::capture`] for a program over a bare weight table (`host`
    /// gives the shapes; `weights` must be its upload).
    pub fn capture_program(
        &mut self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
    ) -> Result<CapturedGraph, BackendError> {
        self.alive()?;
        let r = self.capture_inner(host, weights, program);
        self.track(r)
    }

    /// [`Backend::run_eager`] for a program over a bare weight table.
    pub fn run_program_eager(
        &mut self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
        rows: &BatchRows,
    ) -> Result<Vec<f32>, BackendError> {
        self.alive()?;
        let r = self.eager_inner(host, weights, program, rows);
        self.track(r)
    }

    /// Per-step GPU time (µs) of a program, run `reps` times on the graph
    /// stream without capture (with scratch buffers; for tuning and reports).
    pub fn profile_program(
        &mut self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
        reps: usize,
    ) -> Result<Vec<(String, f64)>, BackendError> {
        self.profile_program_on(host, weights, program, None, reps)
    }

    /// [`CudaBackend::profile_program`] with `rows` packed into the inputs
    /// (a packed program's kernels take their work from its inputs: on zeros
    /// its varlen attention has nothing to do).
    pub fn profile_program_on(
        &mut self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
        rows: Option<&BatchRows>,
        reps: usize,
    ) -> Result<Vec<(String, f64)>, BackendError> {
        self.alive()?;
        let r = (|| {
            let plan = self.plan_of(host, weights, program)?;
            let inner = &mut *self.inner;
            let ctx = inner.ctx.clone();
            let arena = DeviceBuf::zeroed(&ctx, plan.arena_bytes).cu("profile arena")?;
            let io = DeviceBuf::zeroed(&ctx, plan.input_bytes + plan.output_elems * 4 + mem::ALIGN)
                .cu("profile io")?;
            let bases = Bases {
                weights: &weights.ptrs,
                inputs: io.ptr(),
                output: io.ptr() + align_up(plan.input_bytes, mem::ALIGN) as u64,
                arena: arena.ptr(),
                counters: inner.counters.ptr(),
                staged: (0, 0),
            };
            let ws = &inner.workspace;
            ctx.bind_to_thread().cu("bind context")?;
            if let Some(rows) = rows {
                let mut staged = vec![0u32; plan.input_bytes.div_ceil(4)];
                // SAFETY: `staged` holds input_bytes, 4-byte aligned; the
                // caller checked `rows` against the program.
                unsafe {
                    graph::pack_inputs(&plan, rows, staged.as_mut_ptr() as *mut u8, &mut Vec::new())
                };
                // SAFETY: pageable copy into `io`, which holds input_bytes first.
                unsafe { dres::memcpy_htod_async(io.ptr(), &staged, inner.stream.cu_stream()) }
                    .cu("copy profile inputs")?;
                inner.stream.synchronize().cu("copy profile inputs")?;
            }
            let steps = resolve::resolve(
                &plan,
                &bases,
                &inner.kernels,
                &mut inner.matmul,
                ws.bytes(),
                Some((ws.ptr(), &inner.stream)),
            )?;
            let r = launch::profile(
                &steps,
                &inner.matmul,
                ws.ptr(),
                ws.bytes(),
                &inner.stream,
                reps,
            );
            inner.stream.synchronize().cu("profile")?;
            r
        })();
        self.track(r)
    }

    fn alive(&self) -> Result<(), BackendError> {
        match &self.faulted {
            Some(f) => Err(BackendError::DeviceFault(format!(
                "device already faulted: {f}"
            ))),
            None => Ok(()),
        }
    }

    /// Records a fatal error so every later call fails fast.
    fn track<T>(&mut self, r: Result<T, BackendError>) -> Result<T, BackendError> {
        match r {
            Err(e) if e.is_fatal() => {
                if self.faulted.is_none() {
                    tracing::error!(target: "replayd::cuda", "GPU {}: {e}", self.info.ordinal);
                    self.faulted = Some(e.to_string());
                }
                Err(e)
            }
            Err(e @ (BackendError::Other(_) | BackendError::Unsupported(_))) => {
                // A cuBLASLt or launch failure may be the first sign of a
                // sticky error: ask the context.
                let probe = {
                    let c = &self.inner.ctx;
                    c.bind_to_thread().and_then(|_| c.synchronize())
                };
                match probe {
                    Err(pe)
                        if error::classify_cu_code(error::cu_code(&pe))
                            == error::ErrorClass::Sticky =>
                    {
                        let f = driver_error(&format!("{e}; then"), pe);
                        self.faulted = Some(f.to_string());
                        Err(f)
                    }
                    _ => Err(e),
                }
            }
            other => other,
        }
    }

    /// The model's arena if it is large enough, else a new one (returned with
    /// `true`: the new graph is charged for it).
    fn arena_for(
        &self,
        weights: &CudaWeights,
        bytes: usize,
    ) -> Result<(Arc<Arena>, bool), BackendError> {
        let mut slot = weights
            .arena
            .lock()
            .map_err(|_| BackendError::Other("arena lock poisoned".into()))?;
        if let Some(a) = slot.as_ref() {
            if a.bytes() >= bytes {
                return Ok((a.clone(), false));
            }
            tracing::info!(
                target: "replayd::cuda",
                "activation arena grows from {} to {bytes} bytes (capture the largest bucket first to avoid this)",
                a.bytes()
            );
        }
        let a = Arena::new(DeviceBuf::alloc(&self.inner.ctx, bytes).cu("activation arena")?);
        *slot = Some(a.clone());
        Ok((a, true))
    }

    fn capture_inner(
        &mut self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
    ) -> Result<CapturedGraph, BackendError> {
        let plan = self.plan_of(host, weights, program)?;
        // Small graphs read and write the batch's pinned slot themselves.
        let plan = plan.for_graph(&self.limits);
        let staged = !plan.staged.is_empty();
        let (arena, charged) = self.arena_for(weights, plan.arena_bytes)?;
        let arena_charge = if charged { arena.bytes() as u64 } else { 0 };
        let inner = &mut *self.inner;
        let ctx = inner.ctx.clone();
        let inputs = DeviceBuf::zeroed(&ctx, plan.input_bytes).cu("static inputs")?;
        let output = DeviceBuf::zeroed(&ctx, plan.output_elems * 4).cu("static output")?;
        // The first slot; a staged graph is captured pointing at it.
        let first_slot = Slot::new(&ctx, &plan)?;
        let bases = Bases {
            weights: &weights.ptrs,
            inputs: inputs.ptr(),
            output: output.ptr(),
            arena: arena.buf.ptr(),
            counters: inner.counters.ptr(),
            staged: if staged {
                first_slot.device_addrs()
            } else {
                (0, 0)
            },
        };
        let ws = &inner.workspace;
        ctx.bind_to_thread().cu("bind context")?;
        let steps = resolve::resolve(
            &plan,
            &bases,
            &inner.kernels,
            &mut inner.matmul,
            ws.bytes(),
            self.options
                .matmul_autotune
                .then_some((ws.ptr(), &inner.stream)),
        )?;
        ctx.bind_to_thread().cu("bind context")?;
        // Warm-up (module loading, cuBLASLt kernel selection), outside the capture.
        launch::enqueue(&steps, &inner.matmul, ws.ptr(), ws.bytes(), &inner.stream)?;
        inner.stream.synchronize().cu("warm-up")?;

        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        inner
            .stream
            .begin_capture(mode)
            .cu("cuStreamBeginCapture")?;
        let body = launch::enqueue(&steps, &inner.matmul, ws.ptr(), ws.bytes(), &inner.stream);
        // Always end the capture, so the stream is usable whatever happened.
        let end = inner.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        body?;
        let exec_graph = end
            .cu("cuStreamEndCapture/cuGraphInstantiate")?
            .ok_or_else(|| BackendError::Other("the capture recorded nothing".into()))?;
        let counts = graph::node_counts(&exec_graph)?;
        let summary = graph::describe_nodes(&counts);
        if counts.contains_key("MEM_ALLOC") || counts.contains_key("MEM_FREE") {
            tracing::warn!(
                target: "replayd::cuda",
                "graph {} contains allocation nodes: {summary}",
                plan.label()
            );
        } else {
            tracing::debug!(
                target: "replayd::cuda",
                "captured graph {} of {} steps: {summary}",
                plan.label(),
                plan.steps.len()
            );
        }
        let staged_io = if staged {
            Some(StagedIo::find(&exec_graph, &plan, &inner.kernels, &bases)?)
        } else {
            None
        };
        exec_graph.upload().cu("cuGraphUpload")?;
        // One replay to surface launch errors now rather than on the first batch.
        exec_graph.launch().cu("first replay")?;
        inner.stream.synchronize().cu("first replay")?;
        let mut g = CapturedGraph::new(
            exec_graph,
            plan,
            inputs,
            output,
            arena,
            arena_charge,
            inner.stream.clone(),
            ctx,
            counts,
            vec![first_slot],
            staged_io,
        );
        g.reserve_slots(self.initial_slots)?;
        Ok(g)
    }

    fn launch_inner(
        &mut self,
        graph: &mut CapturedGraph,
        rows: &BatchRows,
    ) -> Result<CudaPending, BackendError> {
        if !Arc::ptr_eq(&graph.stream, &self.inner.stream) {
            return Err(BackendError::InvalidBatch(
                "graph belongs to another backend".into(),
            ));
        }
        let slot: Arc<Slot> = graph.take_slot()?;
        let plan = &graph.plan;
        let order = &mut graph.tile_order;
        let values = rows.rows() * plan.output_dim;
        let result = (|| {
            // SAFETY: the slot is ours (taken above): no copy reads or writes it.
            unsafe { graph::pack_inputs(plan, rows, slot.input_ptr(), order) };
            let s = &self.inner.stream;
            let cs = s.cu_stream();
            self.inner.ctx.bind_to_thread().cu("bind context")?;
            if let Some(staged) = graph.staged.as_mut() {
                // The graph's first and last kernels read and write the slot.
                let input = slot.input_words(plan.input_bytes);
                staged.point_at(&graph.exec, slot.device_addrs(), values, input)?;
                // The output the host polls in `collect`, reset.
                if slot.polls_output() {
                    slot.clear_output(values);
                }
                graph.exec.launch().cu("cuGraphLaunch")?;
            } else {
                // SAFETY: pinned source of input_bytes; the device block has the same size.
                unsafe {
                    let src =
                        std::slice::from_raw_parts(slot.input_ptr() as *const u8, plan.input_bytes);
                    dres::memcpy_htod_async(graph.inputs.ptr(), src, cs).cu("copy inputs")?;
                }
                graph.exec.launch().cu("cuGraphLaunch")?;
                // SAFETY: pinned destination of `values` floats; the output holds at least that.
                unsafe {
                    let dst = std::slice::from_raw_parts_mut(slot.output_ptr(), values);
                    dres::memcpy_dtoh_async(dst, graph.output.ptr(), cs).cu("copy output")?;
                }
            }
            slot.event.record(s).cu("cuEventRecord")?;
            Ok(())
        })();
        match result {
            Ok(()) => Ok(CudaPending {
                slot,
                values,
                collected: false,
            }),
            Err(e) => {
                slot.release();
                Err(e)
            }
        }
    }

    fn eager_inner(
        &mut self,
        host: &Weights,
        weights: &CudaWeights,
        program: &Program,
        rows: &BatchRows,
    ) -> Result<Vec<f32>, BackendError> {
        let plan: Plan = self.plan_of(host, weights, program)?;
        let inner = &mut *self.inner;
        let ctx = inner.ctx.clone();
        let grow =
            |slot: &mut Option<DeviceBuf>, bytes: usize, what: &str| -> Result<u64, BackendError> {
                if slot.as_ref().is_none_or(|b| b.bytes() < bytes) {
                    *slot = None; // free first
                    *slot = Some(DeviceBuf::alloc(&ctx, bytes).cu(what)?);
                }
                Ok(slot.as_ref().map(|b| b.ptr()).unwrap_or(0))
            };
        let ws_bytes = inner.workspace.bytes();
        let ws = grow(
            &mut inner.eager.workspace,
            ws_bytes,
            "eager cuBLASLt workspace",
        )?;
        let arena = grow(
            &mut inner.eager.arena,
            plan.arena_bytes,
            "eager activations",
        )?;
        let out_off = align_up(plan.input_bytes, mem::ALIGN);
        let io = grow(
            &mut inner.eager.io,
            out_off + plan.output_elems * 4,
            "eager inputs/outputs",
        )?;
        if inner.eager.counters.is_none() {
            inner.eager.counters =
                Some(DeviceBuf::zeroed(&ctx, plan::COUNTER_BLOCK_BYTES).cu("eager counters")?);
        }
        let counters = inner.eager.counters.as_ref().map(|b| b.ptr()).unwrap_or(0);
        let bases = Bases {
            weights: &weights.ptrs,
            inputs: io,
            output: io + out_off as u64,
            arena,
            counters,
            staged: (0, 0),
        };
        ctx.bind_to_thread().cu("bind context")?;
        let steps = resolve::resolve(
            &plan,
            &bases,
            &inner.kernels,
            &mut inner.matmul,
            ws_bytes,
            None,
        )?;
        let mut host = vec![0u32; plan.input_bytes.div_ceil(4)];
        // SAFETY: `host` holds input_bytes, 4-byte aligned; rows validated.
        unsafe { graph::pack_inputs(&plan, rows, host.as_mut_ptr() as *mut u8, &mut Vec::new()) };
        let s = &inner.eager_stream;
        let cs = s.cu_stream();
        ctx.bind_to_thread().cu("bind context")?;
        let values = rows.rows() * plan.output_dim;
        let mut out = vec![0f32; values];
        // SAFETY: pageable copies (staged by the driver); sizes match the buffers.
        unsafe { dres::memcpy_htod_async(io, &host, cs) }.cu("copy inputs (eager)")?;
        launch::enqueue(&steps, &inner.matmul, ws, ws_bytes, s)?;
        // SAFETY: as above.
        unsafe { dres::memcpy_dtoh_async(&mut out, io + out_off as u64, cs) }
            .cu("copy output (eager)")?;
        s.synchronize().cu("eager run")?;
        Ok(out)
    }

    fn upload_inner(&mut self, host: &Weights, dtype: DType) -> Result<CudaWeights, BackendError> {
        if !dtype.is_float() {
            return Err(BackendError::Unsupported(format!("compute dtype {dtype}")));
        }
        let (buf, ptrs) = upload_to(&self.inner.ctx, host, dtype, UPLOAD_STAGING_BYTES)?;
        Ok(CudaWeights {
            buf,
            ptrs,
            dtype,
            arena: Mutex::new(None),
        })
    }

    /// Writes far out of bounds (fault injection): the context is lost,
    /// as after a real illegal address.
    fn inject_inner(&mut self) -> Result<(), BackendError> {
        let ptr = self.inner.workspace.ptr();
        // 1 TiB past the end of a real allocation: unmapped on any GPU.
        let offset: i64 = 1 << 38;
        let mut args: Vec<*mut std::ffi::c_void> = vec![
            &ptr as *const u64 as *mut std::ffi::c_void,
            &offset as *const i64 as *mut std::ffi::c_void,
        ];
        self.launch_fault_kernel("fault_oob_write", 32, &mut args)?;
        self.inner.stream.synchronize().cu("fault kernel")
    }

    /// Queues a kernel that never ends on the replay stream (fault
    /// injection): every later batch waits behind it.
    fn hang_inner(&mut self) -> Result<(), BackendError> {
        // The first word of the kernel counters: zero between kernels, and
        // nothing writes it while the spin kernel holds the stream.
        let flag = self.inner.counters.ptr();
        let mut args: Vec<*mut std::ffi::c_void> =
            vec![&flag as *const u64 as *mut std::ffi::c_void];
        self.launch_fault_kernel("fault_spin", 1, &mut args)
    }

    /// Launches the fault-injection kernel `name` as one block of
    /// `threads` on the replay stream.
    fn launch_fault_kernel(
        &self,
        name: &str,
        threads: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), BackendError> {
        let f = self
            .inner
            .kernels
            .get(name)
            .ok_or_else(|| BackendError::Other(format!("kernel {name} not loaded")))?
            .cu_function();
        self.inner.ctx.bind_to_thread().cu("bind context")?;
        let s = &self.inner.stream;
        // SAFETY: `args` match the kernel's parameters; the fault kernels
        // write out of bounds or spin forever on purpose.
        unsafe { dres::launch_kernel(f, (1, 1, 1), (threads, 1, 1), 0, s.cu_stream(), args) }
            .cu(name)
    }
}

impl Backend for CudaBackend {
    type Weights = CudaWeights;
    type Graph = CapturedGraph;
    type Pending = CudaPending;

    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn upload(&mut self, model: &Model) -> Result<CudaWeights, BackendError> {
        self.upload_weights(&model.weights, model.info.dtype)
    }

    fn capture(
        &mut self,
        model: &Model,
        weights: &CudaWeights,
        program: &Program,
    ) -> Result<CapturedGraph, BackendError> {
        self.alive()?;
        if weights.dtype != model.info.dtype {
            return Err(BackendError::Other(
                "weights were uploaded for another dtype".into(),
            ));
        }
        self.capture_program(&model.weights, weights, program)
    }

    fn graph_memory_bytes(&self, graph: &CapturedGraph) -> u64 {
        graph.memory().total_bytes
    }

    fn free_memory(&mut self) -> Result<Option<u64>, BackendError> {
        Ok(Some(self.mem_info()?.0 as u64))
    }

    fn graph_need(
        &mut self,
        model: &Model,
        weights: &CudaWeights,
        program: &Program,
    ) -> Result<GraphNeed, BackendError> {
        let plan = self.plan_of(&model.weights, weights, program)?;
        let plan = plan.for_graph(&self.limits);
        Ok(GraphNeed {
            arena_bytes: plan.arena_bytes as u64,
            fixed_bytes: (plan.input_bytes + plan.output_elems * 4) as u64,
        })
    }

    fn resident_bytes(&self, weights: &CudaWeights) -> (u64, u64) {
        (weights.bytes(), weights.arena_bytes())
    }

    fn launch(
        &mut self,
        graph: &mut CapturedGraph,
        rows: &BatchRows,
    ) -> Result<CudaPending, BackendError> {
        self.alive()?;
        let r = self.launch_inner(graph, rows);
        self.track(r)
    }

    fn collect(&mut self, mut pending: CudaPending) -> Result<Vec<f32>, BackendError> {
        self.alive()?;
        // A staged graph's output says itself when it is in the slot;
        // otherwise the graph's event does.
        // (An empty batch has nothing to poll: its event says when the
        // graph is done with the slot.)
        let r = if pending.slot.polls_output() && pending.values > 0 {
            pending
                .slot
                .wait_output(pending.values)
                .cu("wait for batch")
        } else {
            pending.slot.event.synchronize().cu("wait for batch")
        };
        let r = r.map(|_| {
            // SAFETY: the event covers the copy into the slot.
            unsafe { pending.slot.output(pending.values) }.to_vec()
        });
        pending.collected = true;
        pending.slot.release();
        self.track(r)
    }

    fn run_eager(
        &mut self,
        model: &Model,
        weights: &CudaWeights,
        program: &Program,
        rows: &BatchRows,
    ) -> Result<Vec<f32>, BackendError> {
        self.run_program_eager(&model.weights, weights, program, rows)
    }

    fn inject_hang(&mut self) -> Result<(), BackendError> {
        self.hang_inner()
    }

    fn inject_fault(&mut self) -> Result<(), BackendError> {
        self.alive()?;
        match self.inject_inner() {
            Err(e) if e.is_fatal() => {
                self.faulted = Some(format!("injected: {e}"));
                tracing::warn!(target: "replayd::cuda", "GPU {}: fault injected: {e}", self.info.ordinal);
                Ok(())
            }
            Err(e) => Err(e),
            Ok(()) => Err(BackendError::Other(
                "the fault kernel completed without a fault".into(),
            )),
        }
    }
}

/// Uploads every weight into one device buffer, each at an
/// `mem::ALIGN`-aligned offset (the padding zeroed), in float `dtype`; returns
/// the buffer and each weight's address. A weight held in `dtype` already (as
/// the checkpoint stores it, usually a slice of the mapped file) is copied
/// from where it lies; any other is converted element by element, a piece at
/// a time, through one staging buffer of at most `staging_bytes`, so no
/// whole-model (or whole-tensor) copy is ever made on the host.
fn upload_to(
    ctx: &Arc<CudaContext>,
    host: &Weights,
    dtype: DType,
    staging_bytes: usize,
) -> Result<(DeviceBuf, Vec<u64>), BackendError> {
    let size = dtype.size();
    let mut offsets = Vec::with_capacity(host.len());
    let mut total = 0usize;
    for (_, t) in host.iter() {
        offsets.push(total);
        total += align_up(t.data.len() * size, mem::ALIGN);
    }
    let buf = DeviceBuf::zeroed(ctx, total).cu("weights")?;
    let copy = |dst: u64, src: &[u8]| -> Result<(), BackendError> {
        // SAFETY: `dst` lies in `buf` with room for `src` (offsets above);
        // synchronous copy from host memory we borrow.
        unsafe { sys::cuMemcpyHtoD_v2(dst, src.as_ptr() as *const std::ffi::c_void, src.len()) }
            .result()
            .cu("copy weights")
    };
    let mut staging = Vec::new();
    let per_piece = (staging_bytes / size).max(1);
    for ((_, t), &off) in host.iter().zip(&offsets) {
        let dst = buf.ptr() + off as u64;
        if t.data.is_empty() {
            continue;
        }
        if let Some(src) = t.data.le_bytes(dtype) {
            copy(dst, src)?;
            continue;
        }
        let mut first = 0;
        while first < t.data.len() {
            let n = per_piece.min(t.data.len() - first);
            staging.resize(n * size, 0u8);
            t.data.write_as(dtype, first, &mut staging);
            copy(dst + (first * size) as u64, &staging)?;
            first += n;
        }
    }
    let ptrs = offsets.iter().map(|&o| buf.ptr() + o as u64).collect();
    Ok((buf, ptrs))
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.faulted.is_some() {
            // The device is poisoned: leave every handle alone (the process is
            // about to exit; drop handlers could only fail or block).
            return;
        }
        let _ = self.inner.stream.synchronize();
        let _ = self.inner.eager_stream.synchronize();
        // SAFETY: dropped exactly once, here.
        unsafe { ManuallyDrop::drop(&mut self.inner) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every weight reads back as `write_as` converts it, in each compute
    /// dtype, whether copied as stored or converted piecewise (a staging
    /// buffer of 256 bytes: several pieces per tensor). Needs a GPU; passes
    /// without one.
    #[test]
    fn weights_upload_as_stored_or_converted() {
        use crate::model::WeightData;
        if cuda_device_count().map_or(true, |n| n == 0) {
            return;
        }
        let ctx = CudaContext::new(0).expect("a context on GPU 0");
        let values: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let bytes = |f: fn(f32) -> [u8; 2]| -> bytes::Bytes {
            values
                .iter()
                .flat_map(|&v| f(v))
                .collect::<Vec<u8>>()
                .into()
        };
        let mut w = Weights::new();
        w.push("computed f32", vec![1000], values.clone());
        w.push("empty", vec![0], Vec::new());
        w.push_data(
            "stored bf16",
            vec![10, 100],
            WeightData::from_le_bytes(
                DType::BF16,
                bytes(|v| half::bf16::from_f32(v).to_le_bytes()),
            ),
        );
        w.push_data(
            "stored f16",
            vec![1000],
            WeightData::from_le_bytes(DType::F16, bytes(|v| half::f16::from_f32(v).to_le_bytes())),
        );
        let f32_bytes: Vec<u8> = values[..999].iter().flat_map(|v| v.to_le_bytes()).collect();
        w.push_data(
            "stored f32",
            vec![999],
            WeightData::from_le_bytes(DType::F32, f32_bytes.into()),
        );
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (buf, ptrs) = upload_to(&ctx, &w, dtype, 256).unwrap();
            let mut back = vec![0u8; buf.bytes()];
            // SAFETY: `back` holds the whole buffer; synchronous copy.
            unsafe { dres::memcpy_dtoh_sync(&mut back, buf.ptr()) }.unwrap();
            let mut end = 0;
            for ((_, t), &ptr) in w.iter().zip(&ptrs) {
                let off = (ptr - buf.ptr()) as usize;
                assert!(
                    back[end..off].iter().all(|&b| b == 0),
                    "padding before {}",
                    t.name
                );
                let mut want = vec![0u8; t.data.len() * dtype.size()];
                t.data.write_as(dtype, 0, &mut want);
                end = off + want.len();
                assert!(back[off..end] == want[..], "{} as {dtype}", t.name);
            }
        }
    }

    #[test]
    fn no_gpu_here_is_an_error_not_a_panic() {
        // On machines with a GPU the backend starts; here (CI) an error.
        if cuda_device_count().is_err() {
            let e = CudaBackend::new(0, CudaOptions::default())
                .err()
                .expect("no GPU");
            assert!(matches!(e, BackendError::Unsupported(_)), "{e:?}");
        }
    }
}
