#![no_main]
//! See `replayd::fuzz::config_text`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| replayd::fuzz::config_text(data));
