//! PLACEHOLDER until the model/CPU-backend branch lands (signature only).
use super::{Backend, BackendError, DeviceInfo};
use crate::model::{BatchRows, Model, Program};

pub struct CpuBackend;

impl CpuBackend {
    pub fn new(_ordinal: usize, _threads: usize) -> Self {
        CpuBackend
    }
}

impl Backend for CpuBackend {
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
