//! A captured graph with its static buffers, the shared activation arena, and
//! the pinned staging slots that let batches overlap.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use super::error::DriverResultExt;
use super::kernels::Kernels;
use super::launch;
use super::mem::{align_up, DeviceBuf, PinnedBuf};
use super::plan::{
    write_tile_table, Arg, Loc, Plan, StagedCount, Step, OUTPUT_SENTINEL, TILE_ENTRY,
};
use super::resolve::{self, Bases, RArg};
use crate::backend::BackendError;
use crate::model::batch::{BatchRows, PackTarget};
use crate::model::InputRole;

/// An activation arena shared by all graphs of one model (only one graph
/// replays at a time on the worker's stream, so they may share it).
pub struct Arena {
    pub buf: DeviceBuf,
    /// Graphs currently using it.
    users: AtomicUsize,
}

impl Arena {
    pub fn new(buf: DeviceBuf) -> Arc<Arena> {
        Arc::new(Arena {
            buf,
            users: AtomicUsize::new(0),
        })
    }

    pub fn bytes(&self) -> usize {
        self.buf.bytes()
    }

    pub fn users(&self) -> usize {
        self.users.load(Ordering::Relaxed)
    }
}

/// Packs `rows` into a host buffer laid out like the plan's input block:
/// padded rows, or for a packed plan its sequences end to end
/// ([`BatchRows::pack_packed`]) and the varlen attention's tile tables
/// ([`write_tile_table`]), so one copy moves everything a replay reads.
/// `order` is the tile table's sort scratch (a graph keeps one, so that its
/// replays do not allocate).
///
/// # Safety
/// `base` must point at `plan.input_bytes` writable bytes, 4-byte aligned,
/// that no copy is reading; `rows` must have passed
/// [`ProgramFacts::check_rows`](crate::model::ProgramFacts::check_rows).
pub unsafe fn pack_inputs(
    plan: &Plan,
    rows: &BatchRows,
    base: *mut u8,
    order: &mut Vec<(usize, usize)>,
) {
    for slot in &plan.inputs {
        let p = base.add(slot.offset);
        if slot.role == InputRole::Features {
            let dst = std::slice::from_raw_parts_mut(p as *mut f32, slot.elems);
            rows.pack_input(plan.layout, slot.role, plan.seq, PackTarget::F32(dst));
        } else {
            let dst = std::slice::from_raw_parts_mut(p as *mut i32, slot.elems);
            rows.pack_input(plan.layout, slot.role, plan.seq, PackTarget::I32(dst));
        }
    }
    if plan.tile_tables.is_empty() {
        return;
    }
    let (crate::model::program::Layout::Packed { tokens }, BatchRows::Tokens(seqs)) =
        (plan.layout, rows)
    else {
        unreachable!("tile tables belong to packed plans of token rows")
    };
    for t in &plan.tile_tables {
        let dst = std::slice::from_raw_parts_mut(
            base.add(t.offset) as *mut i32,
            t.max_tiles * TILE_ENTRY,
        );
        write_tile_table(seqs.iter().map(Vec::len), tokens, t.qt, dst, order);
    }
}

/// One in-flight batch's pinned memory: `[input block | output]`.
pub struct Slot {
    pinned: PinnedBuf,
    out_offset: usize,
    out_elems: usize,
    /// [`Plan::poll_output`].
    poll_output: bool,
    /// The device's address of `pinned` (mapped host memory), for staged
    /// graphs ([`StagedIo`]).
    device_addr: u64,
    pub event: CudaEvent,
    busy: AtomicBool,
}

impl Slot {
    pub(crate) fn new(ctx: &Arc<CudaContext>, plan: &Plan) -> Result<Arc<Slot>, BackendError> {
        let out_offset = align_up(plan.input_bytes, 64);
        let bytes = out_offset + plan.output_elems * 4;
        let pinned = PinnedBuf::alloc(ctx, bytes).cu("cuMemHostAlloc (staging)")?;
        let device_addr = pinned.device_addr().cu("cuMemHostGetDevicePointer")?;
        let event = ctx.new_event(None).cu("cuEventCreate")?;
        Ok(Arc::new(Slot {
            pinned,
            out_offset,
            out_elems: plan.output_elems,
            poll_output: plan.poll_output,
            device_addr,
            event,
            busy: AtomicBool::new(false),
        }))
    }

    /// The device's addresses of the input block and the output (see
    /// [`super::resolve::Bases::staged`]).
    pub fn device_addrs(&self) -> (u64, u64) {
        (self.device_addr, self.device_addr + self.out_offset as u64)
    }

    pub fn input_ptr(&self) -> *mut u8 {
        self.pinned.as_ptr()
    }

    /// The first `bytes / 4` words of the input block as the host packed
    /// them (a staged plan's block is whole words; the device never writes
    /// it).
    pub fn input_words(&self, bytes: usize) -> &[u32] {
        let n = (bytes / 4).min(self.out_offset / 4);
        // SAFETY: in bounds (the input block precedes the output), 4-byte
        // aligned pinned memory, written only by the host.
        unsafe { std::slice::from_raw_parts(self.pinned.as_ptr() as *const u32, n) }
    }

    /// The first `n` output values.
    ///
    /// # Safety
    /// The copy into the slot must have completed (its event synchronised).
    pub unsafe fn output(&self, n: usize) -> &[f32] {
        let n = n.min(self.out_elems);
        std::slice::from_raw_parts(self.pinned.as_ptr().add(self.out_offset) as *const f32, n)
    }

    pub fn output_ptr(&self) -> *mut f32 {
        // SAFETY: in bounds by construction.
        unsafe { self.pinned.as_ptr().add(self.out_offset) as *mut f32 }
    }

    /// Spins until `ready()` (then acquires what the device wrote before),
    /// querying the event every 1,024 spins: a failed graph returns its
    /// error, a completed one ends the wait.
    fn spin_until(
        &self,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), cudarc::driver::DriverError> {
        let mut spins: u32 = 0;
        loop {
            if ready() {
                std::sync::atomic::fence(Ordering::Acquire);
                return Ok(());
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && self.event.try_is_complete()? {
                return Ok(());
            }
            std::hint::spin_loop();
        }
    }

    /// The first `n` output values as words, as atomics (the device writes
    /// them across PCIe).
    fn output_words(&self, n: usize) -> &[AtomicU32] {
        let n = n.min(self.out_elems);
        // SAFETY: `n` f32 of the output, inside the allocation, 64-byte
        // aligned; the host touches them atomically until the wait is over.
        unsafe {
            std::slice::from_raw_parts(
                self.pinned.as_ptr().add(self.out_offset) as *const AtomicU32,
                n,
            )
        }
    }

    /// Whether the host polls the output itself ([`Plan::poll_output`]).
    pub fn polls_output(&self) -> bool {
        self.poll_output
    }

    /// Fills the first `n` output values with [`OUTPUT_SENTINEL`] before a
    /// launch (the slot is ours: its last batch was collected).
    pub fn clear_output(&self, n: usize) {
        for w in self.output_words(n) {
            w.store(OUTPUT_SENTINEL, Ordering::Relaxed);
        }
        // The launch that follows publishes them to the device.
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    /// Waits until the graph has written each of the first `n` output
    /// values (none is the sentinel any more); the event is queried now and
    /// then, so a failed graph, which never writes them, returns its error.
    pub fn wait_output(&self, n: usize) -> Result<(), cudarc::driver::DriverError> {
        let out = self.output_words(n);
        // Values land in any order; the scan restarts from the first one
        // still missing.
        let mut from = 0;
        self.spin_until(|| {
            match out[from..]
                .iter()
                .position(|w| w.load(Ordering::Relaxed) == OUTPUT_SENTINEL)
            {
                None => true,
                Some(i) => {
                    from += i;
                    false
                }
            }
        })
    }

    pub fn release(&self) {
        self.busy.store(false, Ordering::Release);
    }

    pub fn pinned_bytes(&self) -> usize {
        self.pinned.bytes()
    }
}

/// A staged graph's kernels that read or write the batch's pinned slot
/// ([`Plan::with_staged_io`]: `stage_in` or the embedding first, `stage_out`
/// or the pooling last) and the slot they address now: before a batch in
/// another slot, or of another size, launches, `StagedIo::point_at` sets
/// those nodes' arguments in the executable graph (which affects later
/// launches only, never one already queued). The last node writes only the
/// batch's own rows: a lone text in a 64-sequence budget sends 1.5 KB over
/// PCIe, not 96.
pub struct StagedIo {
    nodes: Vec<StagedNode>,
    /// The plan's output floats, and floats a row.
    max_values: usize,
    output_dim: usize,
}

/// One kernel node that addresses the slot: its launch shape, its
/// arguments as last set, and which of them follow the batch.
struct StagedNode {
    node: sys::CUgraphNode,
    params: sys::CUDA_KERNEL_NODE_PARAMS,
    args: Vec<RArg>,
    patches: Vec<(usize, Patch)>,
}

/// How an argument of a [`StagedNode`] follows the batch.
#[derive(Clone, Copy)]
enum Patch {
    /// The slot's input block plus a byte offset.
    Input(u64),
    /// The slot's output plus a byte offset.
    Output(u64),
    /// The batch's size.
    Count(StagedCount),
    /// The batch's input block, by value ([`Arg::Inline`]).
    Inline,
}

// SAFETY: the node handle and function belong to the graph, which moves with
// its `CapturedGraph` and is only used on the thread that owns the backend.
unsafe impl Send for StagedIo {}

impl StagedIo {
    /// Finds the graph's kernel node of each of `plan`'s staged steps (by
    /// function: each is the only node of its kernel, as
    /// [`Plan::with_staged_io`] checks), with the arguments the capture
    /// resolved against `bases` (those of the capture).
    pub(crate) fn find(
        graph: &cudarc::driver::CudaGraph,
        plan: &Plan,
        kernels: &Kernels,
        bases: &Bases<'_>,
    ) -> Result<StagedIo, BackendError> {
        let lost =
            |what: String| BackendError::Other(format!("staged graph {}: {what}", plan.label()));
        let mut funcs: Vec<(sys::CUfunction, Vec<sys::CUgraphNode>)> = Vec::new();
        let mut steps = Vec::with_capacity(plan.staged.len());
        for st in &plan.staged {
            let Some(Step::Kernel { name, args, .. }) = plan.steps.get(st.step) else {
                return Err(lost(format!("step {} is not a kernel", st.step)));
            };
            let func = kernels
                .get(name)
                .ok_or_else(|| lost(format!("kernel {name} is not loaded")))?
                .cu_function();
            let mut patches: Vec<(usize, Patch)> = args
                .iter()
                .enumerate()
                .filter_map(|(i, a)| match a {
                    Arg::Ptr(Loc::StagedInput(o)) => Some((i, Patch::Input(*o as u64))),
                    Arg::Ptr(Loc::StagedOutput(o)) => Some((i, Patch::Output(*o as u64))),
                    Arg::Inline => Some((i, Patch::Inline)),
                    _ => None,
                })
                .collect();
            if let Some((i, unit)) = st.count {
                patches.push((i, Patch::Count(unit)));
            }
            steps.push((name, func, resolve::resolve_args(args, bases), patches));
            funcs.push((func, Vec::new()));
        }
        for node in graph_nodes(graph.cu_graph())? {
            // SAFETY: zeroed is a valid (empty) parameter block to fill.
            let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
            // SAFETY: a node of this live graph; fails (ignored) for non-kernels.
            let ok = unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) };
            if ok != sys::CUresult::CUDA_SUCCESS {
                continue;
            }
            for (f, found) in funcs.iter_mut() {
                if params.func == *f {
                    found.push(node);
                }
            }
        }
        let mut nodes = Vec::with_capacity(steps.len());
        for ((name, func, args, patches), (_, found)) in steps.into_iter().zip(funcs) {
            let [node] = found[..] else {
                return Err(lost(format!("{} nodes run {name}, not one", found.len())));
            };
            // SAFETY: as above; the pointers it returns are not kept.
            let mut params: sys::CUDA_KERNEL_NODE_PARAMS = unsafe { std::mem::zeroed() };
            unsafe { sys::cuGraphKernelNodeGetParams_v2(node, &mut params) }
                .result()
                .cu("cuGraphKernelNodeGetParams")?;
            debug_assert_eq!(params.func, func);
            params.kernelParams = std::ptr::null_mut();
            params.extra = std::ptr::null_mut();
            nodes.push(StagedNode {
                node,
                params,
                args,
                patches,
            });
        }
        Ok(StagedIo {
            nodes,
            max_values: plan.output_elems,
            output_dim: plan.output_dim.max(1),
        })
    }

    /// Points the staged nodes of `exec` at the slot whose input block and
    /// output the device addresses as `addrs`, for a batch of `values`
    /// output floats (at most the plan's output) whose input block is
    /// `input` (the words the host packed into the slot, for a node that
    /// takes them by value); a node whose arguments would not change is
    /// left alone.
    pub(crate) fn point_at(
        &mut self,
        exec: &cudarc::driver::CudaGraph,
        addrs: (u64, u64),
        values: usize,
        input: &[u32],
    ) -> Result<(), BackendError> {
        let values = values.min(self.max_values);
        for n in self.nodes.iter_mut() {
            let mut stale = false;
            for &(i, patch) in &n.patches {
                let v = match patch {
                    Patch::Inline => {
                        // New contents every batch: always set.
                        if let RArg::Inline(block) = &mut n.args[i] {
                            let k = input.len().min(block.len());
                            block[..k].copy_from_slice(&input[..k]);
                        }
                        stale = true;
                        continue;
                    }
                    Patch::Input(o) => RArg::U64(addrs.0 + o),
                    Patch::Output(o) => RArg::U64(addrs.1 + o),
                    Patch::Count(StagedCount::Values) => RArg::I32(values as i32),
                    Patch::Count(StagedCount::Rows) => {
                        RArg::I32(values.div_ceil(self.output_dim) as i32)
                    }
                };
                if n.args[i] != v {
                    n.args[i] = v;
                    stale = true;
                }
            }
            if !stale {
                continue;
            }
            let mut ptrs = launch::arg_ptrs(&n.args);
            let mut p = n.params;
            p.kernelParams = ptrs.as_mut_ptr();
            // SAFETY: a kernel node of the graph `exec` was instantiated from,
            // the same function and shape, arguments of its signature (read
            // during the call).
            let set =
                unsafe { sys::cuGraphExecKernelNodeSetParams_v2(exec.cu_graph_exec(), n.node, &p) }
                    .result()
                    .cu("cuGraphExecKernelNodeSetParams");
            if let Err(e) = set {
                // Unknown now: the next batch sets every node again.
                for n in self.nodes.iter_mut() {
                    for &(i, p) in &n.patches {
                        if !matches!(p, Patch::Inline) {
                            n.args[i] = RArg::I64(-1);
                        }
                    }
                }
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The nodes of a graph.
fn graph_nodes(graph: sys::CUgraph) -> Result<Vec<sys::CUgraphNode>, BackendError> {
    let mut n: usize = 0;
    // SAFETY: a live graph; first call sizes the array.
    unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut n) }
        .result()
        .cu("cuGraphGetNodes")?;
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    let mut n2 = n;
    // SAFETY: `nodes` holds `n` entries.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut n2) }
        .result()
        .cu("cuGraphGetNodes")?;
    nodes.truncate(n2);
    Ok(nodes)
}

/// A launched batch (see [`super::CudaBackend`]'s `launch`/`collect`).
pub struct CudaPending {
    pub(crate) slot: Arc<Slot>,
    pub(crate) values: usize,
    pub(crate) collected: bool,
}

impl CudaPending {
    /// Output values this batch returns (`rows · output_dim`).
    pub fn len(&self) -> usize {
        self.values
    }

    pub fn is_empty(&self) -> bool {
        self.values == 0
    }
}

impl Drop for CudaPending {
    fn drop(&mut self) {
        if !self.collected {
            // Abandoned: the slot may be reused. Its copies are ordered on the
            // stream before any later batch's, and later batches re-pack the
            // whole input block, so only the abandoned batch's data is affected.
            self.slot.release();
        }
    }
}

/// Node counts of a graph by type, e.g. `{"kernel": 40, "memset": 1}`.
pub fn node_counts(
    graph: &cudarc::driver::CudaGraph,
) -> Result<BTreeMap<&'static str, usize>, BackendError> {
    let nodes = graph_nodes(graph.cu_graph())?;
    let mut counts = BTreeMap::new();
    for node in nodes.iter() {
        // Read as u32: an enum value from a newer driver must not become UB.
        let mut t: u32 = u32::MAX;
        // SAFETY: writes one CUgraphNodeType (a u32 enum).
        let _ = unsafe {
            sys::cuGraphNodeGetType(*node, &mut t as *mut u32 as *mut sys::CUgraphNodeType)
        };
        *counts.entry(node_type_name(t)).or_insert(0) += 1;
    }
    Ok(counts)
}

/// The name of a `CUgraphNodeType` value.
pub fn node_type_name(t: u32) -> &'static str {
    match t {
        0 => "kernel",
        1 => "memcpy",
        2 => "memset",
        3 => "host",
        4 => "child_graph",
        5 => "empty",
        6 => "wait_event",
        7 => "event_record",
        8 => "ext_semaphore_signal",
        9 => "ext_semaphore_wait",
        10 => "MEM_ALLOC",
        11 => "MEM_FREE",
        12 => "batch_mem_op",
        13 => "conditional",
        _ => "other",
    }
}

/// `"42 nodes [kernel:41 memset:1]"`.
pub fn describe_nodes(counts: &BTreeMap<&'static str, usize>) -> String {
    let total: usize = counts.values().sum();
    let parts: Vec<String> = counts.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    format!("{total} nodes [{}]", parts.join(" "))
}

/// Device memory of one graph, for metrics and the backend check.
///
/// The activation arena is shared by all graphs of a model. The graph whose
/// capture allocated it (the first, largest one; or one that had to grow it)
/// is charged for all of it, the graphs that reuse it for none, so the totals
/// of a model's graphs add up to the memory really used and each graph's
/// figure is fixed at capture.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct GraphMemory {
    /// The graph's own static input and output buffers.
    pub static_bytes: u64,
    /// Size of the activation arena it uses.
    pub arena_bytes: u64,
    /// Bytes of the arena this graph's program needs.
    pub arena_used_bytes: u64,
    /// Bytes of the arena charged to this graph (all of it, or 0).
    pub arena_charged_bytes: u64,
    /// Graphs sharing the arena now.
    pub arena_users: u64,
    /// `static_bytes + arena_charged_bytes` (what `graph_memory_bytes` reports).
    pub total_bytes: u64,
    /// Pinned host memory of its staging slots.
    pub pinned_host_bytes: u64,
}

/// A captured program: the graph, its static buffers and staging slots.
/// Field order is drop order: the executable graph goes first.
pub struct CapturedGraph {
    pub(crate) exec: cudarc::driver::CudaGraph,
    pub(crate) plan: Plan,
    pub(crate) inputs: DeviceBuf,
    pub(crate) output: DeviceBuf,
    pub(crate) arena: Arc<Arena>,
    /// Arena bytes charged to this graph (see [`GraphMemory`]).
    pub(crate) arena_charge: u64,
    pub(crate) slots: Vec<Arc<Slot>>,
    /// Zero-copy staging (small graphs): the replay reads and writes the
    /// batch's slot itself, with no copies around it.
    pub(crate) staged: Option<StagedIo>,
    /// Sort scratch of the tile tables (packed graphs), kept across replays.
    pub(crate) tile_order: Vec<(usize, usize)>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) ctx: Arc<CudaContext>,
    /// e.g. `"42 nodes [kernel:41 memset:1]"`.
    pub nodes: String,
    pub node_counts: BTreeMap<&'static str, usize>,
}

impl CapturedGraph {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        exec: cudarc::driver::CudaGraph,
        plan: Plan,
        inputs: DeviceBuf,
        output: DeviceBuf,
        arena: Arc<Arena>,
        arena_charge: u64,
        stream: Arc<CudaStream>,
        ctx: Arc<CudaContext>,
        node_counts: BTreeMap<&'static str, usize>,
        slots: Vec<Arc<Slot>>,
        staged: Option<StagedIo>,
    ) -> CapturedGraph {
        arena.users.fetch_add(1, Ordering::Relaxed);
        let tile_order = Vec::with_capacity(if plan.tile_tables.is_empty() {
            0
        } else {
            plan.batch
        });
        CapturedGraph {
            exec,
            plan,
            inputs,
            output,
            arena,
            arena_charge,
            slots,
            staged,
            tile_order,
            stream,
            ctx,
            nodes: describe_nodes(&node_counts),
            node_counts,
        }
    }

    pub fn batch(&self) -> usize {
        self.plan.batch
    }

    pub fn seq(&self) -> usize {
        self.plan.seq
    }

    pub fn output_dim(&self) -> usize {
        self.plan.output_dim
    }

    /// A free staging slot, allocating another when all are in flight.
    pub(crate) fn take_slot(&mut self) -> Result<Arc<Slot>, BackendError> {
        for s in &self.slots {
            if s.busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Ok(s.clone());
            }
        }
        let s = Slot::new(&self.ctx, &self.plan)?;
        s.busy.store(true, Ordering::Release);
        self.slots.push(s.clone());
        Ok(s)
    }

    /// Ensures at least `n` staging slots exist (allocated before serving).
    pub(crate) fn reserve_slots(&mut self, n: usize) -> Result<(), BackendError> {
        while self.slots.len() < n {
            self.slots.push(Slot::new(&self.ctx, &self.plan)?);
        }
        Ok(())
    }

    pub fn memory(&self) -> GraphMemory {
        let static_bytes = (self.inputs.bytes() + self.output.bytes()) as u64;
        GraphMemory {
            static_bytes,
            arena_bytes: self.arena.bytes() as u64,
            arena_used_bytes: self.plan.arena_bytes as u64,
            arena_charged_bytes: self.arena_charge,
            arena_users: self.arena.users() as u64,
            total_bytes: static_bytes + self.arena_charge,
            pinned_host_bytes: self.slots.iter().map(|s| s.pinned_bytes() as u64).sum(),
        }
    }
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        self.arena.users.fetch_sub(1, Ordering::Relaxed);
        // Let in-flight replays finish before their buffers are freed. Errors
        // (a faulted device) are ignored: nothing here may panic.
        let _ = self.stream.synchronize();
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::{plan, Limits};
    use super::*;
    use crate::model::program::one_linear;
    use crate::tensor::DType;

    /// The output sentinel the host polls for is a NaN that no arithmetic
    /// produces (the GPU's canonical NaN is 0x7fffffff, the CPU's
    /// 0xffc00000), so a computed NaN is never taken for "not written yet"
    /// and a written value is never taken for the sentinel.
    #[test]
    fn output_sentinel_is_no_computed_value() {
        assert!(f32::from_bits(OUTPUT_SENTINEL).is_nan());
        let zero = std::hint::black_box(0.0f32);
        let inf = std::hint::black_box(f32::INFINITY);
        for v in [
            f32::NAN,
            -f32::NAN,
            zero / zero,
            inf - inf,
            (-1.0f32 + zero).sqrt(),
            f32::from_bits(0x7fff_ffff),
        ] {
            assert!(v.is_nan());
            assert_ne!(v.to_bits(), OUTPUT_SENTINEL, "{:#x}", v.to_bits());
        }
    }

    fn feature_plan(batch: usize) -> Plan {
        let (program, w) = one_linear(batch);
        plan(&program, &w, DType::F32, false, Limits::new(48 << 10)).unwrap()
    }

    #[test]
    fn feature_rows_pack_padded_with_zeros() {
        let p = feature_plan(4);
        let ok = BatchRows::Features {
            features: 4,
            data: vec![1.0; 8],
        };
        let mut buf = vec![7u8; p.input_bytes];
        unsafe { pack_inputs(&p, &ok, buf.as_mut_ptr(), &mut Vec::new()) };
        let vals: Vec<f32> = buf[..64]
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(&vals[..8], &[1.0; 8]);
        assert_eq!(&vals[8..16], &[0.0; 8]);
    }

    #[test]
    fn token_rows_pack_ids_mask_and_types() {
        let (prog, w) = super::super::plan::test_support::tiny_bert(2, 8);
        let p = plan(&prog, &w, DType::F16, false, Limits::new(48 << 10)).unwrap();
        let rows = BatchRows::Tokens(vec![vec![101, 5, 102], vec![101, 102]]);
        let mut buf = vec![0xffu8; p.input_bytes];
        unsafe { pack_inputs(&p, &rows, buf.as_mut_ptr(), &mut Vec::new()) };
        let ints = |slot: usize| -> Vec<i32> {
            let s = &p.inputs[slot];
            buf[s.offset..s.offset + s.elems * 4]
                .chunks(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        assert_eq!(
            ints(0),
            vec![101, 5, 102, 0, 0, 0, 0, 0, 101, 102, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            ints(1),
            vec![1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(ints(2), vec![0; 16]);
    }

    #[test]
    fn packed_rows_pack_sequences_offsets_and_tiles() {
        let (prog, w) =
            super::super::plan::test_support::packed_bert_dims(16, 4, 16, 384, 12, 1536);
        // The fused attention kernels need no tile table: plan without them.
        let limits = Limits::new(48 << 10);
        let p = plan(&prog, &w, DType::F16, false, limits).unwrap();
        let mut order = Vec::new();
        let mut pack = |buf: &mut Vec<u8>, rows: &BatchRows| {
            unsafe { pack_inputs(&p, rows, buf.as_mut_ptr(), &mut order) };
        };
        let mut buf = vec![0xffu8; p.input_bytes];
        let ints = |buf: &[u8], offset: usize, n: usize| -> Vec<i32> {
            buf[offset..offset + n * 4]
                .chunks(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        pack(
            &mut buf,
            &BatchRows::Tokens(vec![vec![101, 5, 102], vec![], vec![101, 102]]),
        );
        let slot = |i: usize| ints(&buf, p.inputs[i].offset, p.inputs[i].elems);
        let tail = vec![0; 11];
        assert_eq!(slot(0), [&[101, 5, 102, 101, 102][..], &tail].concat());
        assert_eq!(slot(1), vec![0; 16]);
        assert_eq!(slot(2), [&[0, 1, 2, 0, 1][..], &tail].concat());
        assert_eq!(slot(3), vec![0, 3, 3, 5, 5]);
        // The tile table: the 3-token sequence, the 2-token one, the tail, unused.
        let t = &p.tile_tables[0];
        assert_eq!(t.qt, 64);
        assert_eq!(t.max_tiles, 5);
        let table = ints(&buf, t.offset, t.max_tiles * TILE_ENTRY);
        assert_eq!(&table[..12], &[0, 3, 0, 3, 3, 2, 3, 2, 5, 11, 5, 0]);
        assert!(table[12..].iter().all(|&v| v == 0));
        // The next batch in the same staging buffer rewrites every entry.
        pack(&mut buf, &BatchRows::Tokens(vec![vec![7; 16]]));
        let table = ints(&buf, t.offset, t.max_tiles * TILE_ENTRY);
        assert_eq!(&table[..4], &[0, 16, 0, 16]);
        assert!(table[4..].iter().all(|&v| v == 0));
        assert_eq!(ints(&buf, p.inputs[3].offset, 5), vec![0, 16, 16, 16, 16]);
    }

    #[test]
    fn node_names() {
        let mut c = BTreeMap::new();
        c.insert(node_type_name(0), 3);
        c.insert(node_type_name(2), 1);
        assert_eq!(describe_nodes(&c), "4 nodes [kernel:3 memset:1]");
        assert_eq!(node_type_name(10), "MEM_ALLOC");
        assert_eq!(node_type_name(77), "other");
    }
}
