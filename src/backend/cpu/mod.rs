//! The CPU backend (owned by the model/CPU-backend work).
