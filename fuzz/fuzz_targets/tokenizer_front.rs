#![no_main]
//! See `replayd::fuzz::tokenizer_text`; uses the default model's tokenizer
//! (`scripts/dev/fetch-model.sh` fetches it).
use libfuzzer_sys::fuzz_target;
use replayd::daemon::tokenize::TextTokenizer;
use std::sync::OnceLock;

fn tokenizer() -> &'static TextTokenizer {
    static T: OnceLock<TextTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/all-MiniLM-L6-v2");
        TextTokenizer::load(&dir, 256).expect("the default model (scripts/dev/fetch-model.sh)")
    })
}

fuzz_target!(|data: &[u8]| replayd::fuzz::tokenizer_text(tokenizer(), data));
