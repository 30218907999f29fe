#![no_main]
//! See `replayd::fuzz::worker_link`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| replayd::fuzz::worker_link(data));
