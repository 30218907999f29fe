//! PLACEHOLDER until the CUDA branch lands (signature only).
use super::{Backend, BackendError, DeviceInfo};
use crate::model::{BatchRows, Model, Program};

pub struct CudaBackend;

impl CudaBackend {
    pub fn new(_ordinal: usize, _options: CudaOptions) -> Result<Self, BackendError> {
        Ok(CudaBackend)
    }
}

impl Backend for CudaBackend {
    type Weights = ();
    type Graph = ();
    type Pending = ();
    fn info(&self) -> DeviceInfo {
        DeviceInfo::default()
    }
    fn upload(&mut self, _: &Model) -> Result<(), BackendError> {
        unimplemented!()
    }
    fn capture(&mut self, _: &Model, _: &(), _: &Program) -> Result<(), BackendError> {
        unimplemented!()
    }
    fn graph_memory_bytes(&self, _: &()) -> u64 {
        0
    }
    fn launch(&mut self, _: &mut (), _: &BatchRows) -> Result<(), BackendError> {
        unimplemented!()
    }
    fn collect(&mut self, _: ()) -> Result<Vec<f32>, BackendError> {
        unimplemented!()
    }
    fn run_eager(
        &mut self,
        _: &Model,
        _: &(),
        _: &Program,
        _: &BatchRows,
    ) -> Result<Vec<f32>, BackendError> {
        unimplemented!()
    }
}

pub struct CudaOptions {
    pub allow_tf32: bool,
    pub kernel_cache_dir: Option<std::path::PathBuf>,
}

pub fn cuda_device_count() -> Result<usize, String> {
    Err("placeholder".into())
}
