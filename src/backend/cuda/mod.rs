//! The CUDA backend (owned by the CUDA work).
