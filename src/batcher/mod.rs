//! The batcher (see [`queue`] for the rules).
pub mod queue;
