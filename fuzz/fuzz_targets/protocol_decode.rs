#![no_main]
//! See `replayd::fuzz::protocol_request`.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| replayd::fuzz::protocol_request(data));
