//! The state the checks of a run share ([`Ctx`]) and the model under
//! check ([`Subject`]).

use super::args::BackendCheckArgs;
use super::inputs::Rng;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::plan::Limits;
use crate::backend::cuda::CudaBackend;
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::model::Model;

/// What every check of a run shares: the two backends, the arguments, the
/// random inputs and the failures so far.
pub(super) struct Ctx<'a> {
    pub(super) gpu: &'a mut CudaBackend,
    pub(super) cpu: &'a mut CpuBackend,
    pub(super) args: &'a BackendCheckArgs,
    /// The kernel paths the daemon would serve with (`--paths-off` applied).
    pub(super) served: Limits,
    pub(super) rng: Rng,
    pub(super) failures: Vec<String>,
}

/// The model under check: its config entry, the model and its weights on
/// both backends.
#[derive(Clone, Copy)]
pub(super) struct Subject<'a> {
    pub(super) mc: &'a ModelConfig,
    pub(super) model: &'a Model,
    pub(super) gw: &'a <CudaBackend as Backend>::Weights,
    pub(super) cw: &'a <CpuBackend as Backend>::Weights,
}
