//! The kernel sources and the NVRTC options they are compiled with, in one
//! file that uses nothing but `std`: the run-time compiler
//! ([`super::kernels`]) and the build script that embeds cubins (`build.rs`
//! includes this file) compile the same text with the same options, so an
//! embedded cubin is the kernel a run-time compile would have made.

/// `(name, source)` of each named file of `kernels/`, embedded at build time.
macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../../kernels/", $name)))),*]
    };
}

/// The kernel sources, in compile order (embedded at build time).
pub const KERNEL_FILES: &[(&str, &str)] = kernel_files![
    "common.cuh",
    "layernorm.cu",
    "elementwise.cu",
    "attention.cu",
    "pool.cu",
    "skinny.cu",
    "attention_tc.cu",
    // Packed batches (after the files whose helpers they share).
    "embed_packed.cu",
    "pool_packed.cu",
    "attention_varlen.cu",
    // Issue 13's encoder families (after layernorm.cu, whose ln_finish
    // embed_pos.cu shares): XLM-R / MPNet position ids and the Normalize
    // after a Dense module.
    "embed_pos.cu",
    "rownorm.cu",
    // Vectorised LayerNorm / element-wise kernels (after skinny.cu and
    // attention_tc.cu, whose helpers they use).
    "vec.cu",
    // Pooling of long sequences over several blocks (vec.cu's 8-wide loads).
    "pool_split.cu",
    // Linears of few rows with their epilogues (attention_tc.cu's mma,
    // vec.cu's vector loads).
    "gemm_small.cu",
    // Pre-norm encoders with rotary positions (ModernBERT; after
    // layernorm.cu, whose LN_VPT it shares).
    "prenorm.cu",
    // Decoders (Qwen3, EmbeddingGemma): RMSNorm, the q/k norms with rotary,
    // the scaled embedding (after prenorm.cu, whose rotary helpers it uses).
    "decoder.cu",
    "stage.cu",
    "fault.cu",
];

/// All kernel files concatenated into one translation unit, with `#line`
/// directives so compiler messages name the original file and line.
pub fn combined_source() -> String {
    let mut s = String::new();
    for (name, text) in KERNEL_FILES {
        s.push_str(&format!("#line 1 \"{name}\"\n"));
        s.push_str(text);
        if !text.ends_with('\n') {
            s.push('\n');
        }
    }
    s
}

/// The NVRTC options for the architecture flag `arch_flag` (`-arch=sm_90`,
/// `-arch=compute_90`). `--split-compile=0` runs the optimiser on every
/// core (one translation unit of ~130 kernels: most of the compile time).
pub fn nvrtc_options(arch_flag: &str) -> Vec<String> {
    vec![
        arch_flag.to_string(),
        "--std=c++17".to_string(),
        "--split-compile=0".to_string(),
    ]
}

/// The architectures `REPLAYD_EMBED_KERNELS=default` embeds: Ampere (A100,
/// A10/A40/RTX 30, L4/L40/RTX 40), Hopper, Blackwell (B200, RTX 50). A cubin
/// runs on its architecture and on later minor versions of the same major
/// one (sm_80's on an sm_87 part, say).
pub const DEFAULT_EMBED_ARCHS: &[u32] = &[80, 86, 89, 90, 100, 120];

/// Parses a list of architectures: `80,86,sm_90` (a comma or white space
/// between them; `sm_` optional), or `default` for [`DEFAULT_EMBED_ARCHS`].
/// Sorted, without repeats.
pub fn parse_archs(list: &str) -> Result<Vec<u32>, String> {
    let mut archs = Vec::new();
    for word in list.split(|c: char| c == ',' || c.is_whitespace()) {
        let word = word.trim();
        if word.is_empty() {
            continue;
        }
        if word == "default" {
            archs.extend_from_slice(DEFAULT_EMBED_ARCHS);
            continue;
        }
        let digits = word.strip_prefix("sm_").unwrap_or(word);
        match digits.parse::<u32>() {
            Ok(a) if (50..=199).contains(&a) => archs.push(a),
            _ => {
                return Err(format!(
                    "{word:?} is not a GPU architecture (e.g. 90 or sm_90, or `default`)"
                ))
            }
        }
    }
    archs.sort_unstable();
    archs.dedup();
    Ok(archs)
}

/// 64-bit FNV-1a with a chosen offset basis.
fn fnv1a(bytes: &[u8], basis: u64) -> u64 {
    let mut h = basis;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A 128-bit content hash as 32 hex digits (two FNV-1a passes); stable across
/// builds and Rust versions, which `DefaultHasher` is not.
pub fn content_hash(bytes: &[u8]) -> String {
    format!(
        "{:016x}{:016x}",
        fnv1a(bytes, 0xcbf2_9ce4_8422_2325),
        fnv1a(bytes, 0x6c62_272e_07bb_0142)
    )
}
