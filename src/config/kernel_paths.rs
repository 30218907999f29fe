//! `[devices] kernel_paths_off`: the CUDA planner's specialised kernel
//! paths, each on unless named here.
//!
//! Every path is what the planner takes by default because it measured
//! faster than the plainer one it replaces (docs/perf-log.md); a path
//! measured slower is deleted, not kept behind a switch. Switching one off
//! is for measuring it against the path beneath it (`replayd
//! backend-check --paths-off`, `--compare-off`), and for falling back
//! without a rebuild should a specialised kernel misbehave on some GPU.
//! Naming one path turns off that path alone.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// One specialised kernel path of the CUDA planner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelPath {
    /// Attention on tensor cores (`attention_tc*`, `attention_varlen_tc*`;
    /// f16/bf16) instead of the CUDA-core kernels.
    TcAttention,
    /// Linears of at most 16 rows with a small weight on `skinny` (and the
    /// AddLayerNorm after them in its epilogue) instead of cuBLASLt.
    Skinny,
    /// The warp-per-row LayerNorm kernels (`add_ln_vec`, `embed_ln_vec`).
    LnVec,
    /// The 8-wide element-wise kernel (`bias_act_vec`).
    EwVec,
    /// Linears of few rows (f16/bf16) on `gemm_small`, with the bias, the
    /// activation and a following AddLayerNorm in the same kernel.
    GemmSmall,
    /// A `gemm_small` Linear's LayerNorm left to the op that reads it (the
    /// next `gemm_small` or the pooling), so no kernel ends in a last-block
    /// LayerNorm.
    LnDefer,
    /// Programmatic dependent launch between consecutive kernels (sm_90+).
    Pdl,
    /// Small graphs read and write the batch's pinned slot from their first
    /// and last kernels instead of copies around the replay.
    StagedIo,
    /// In a staged graph, the embedding and the pooling read and write the
    /// slot themselves instead of `stage_in` / `stage_out` nodes.
    StageFold,
    /// A staged graph's input block as its first kernel's parameter.
    InlineInput,
    /// The host polls a staged graph's output for the values replacing its
    /// sentinel instead of waiting for the graph's completion event.
    PollOutput,
    /// Padded sequences of at most 16 tokens on the 16-key-block attention.
    AttnS16,
    /// Padded sequences of at least 128 tokens on the 128-query-block
    /// attention (two 16-row tiles a warp; head sizes 32 and 64).
    AttnQ128,
    /// A cuBLASLt Linear followed by an AddLayerNorm adds the residual in
    /// the matmul (its C operand), so the LayerNorm reads one operand.
    MmResidual,
    /// Mean, max and sum pooling of sequences longer than 32 tokens over
    /// several blocks a sequence (`pool_split`) instead of one.
    PoolSplit,
}

impl KernelPath {
    /// Every path, in the order `--help` and the logs list them.
    pub const ALL: [KernelPath; 15] = [
        KernelPath::TcAttention,
        KernelPath::Skinny,
        KernelPath::LnVec,
        KernelPath::EwVec,
        KernelPath::GemmSmall,
        KernelPath::LnDefer,
        KernelPath::Pdl,
        KernelPath::StagedIo,
        KernelPath::StageFold,
        KernelPath::InlineInput,
        KernelPath::PollOutput,
        KernelPath::AttnS16,
        KernelPath::AttnQ128,
        KernelPath::MmResidual,
        KernelPath::PoolSplit,
    ];

    /// The paths the small-shape work added (vectorised LayerNorm and
    /// element-wise kernels, `gemm_small` and its deferred LayerNorm,
    /// programmatic launch, the 16-key attention): off, a plan is the one
    /// of before them. `backend-check` compares each bucket with and
    /// without them by default.
    pub const SMALL_SHAPE: [KernelPath; 6] = [
        KernelPath::LnVec,
        KernelPath::EwVec,
        KernelPath::GemmSmall,
        KernelPath::LnDefer,
        KernelPath::Pdl,
        KernelPath::AttnS16,
    ];

    /// The name in configs, flags and logs (`tc_attention`, `attn_s16`).
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::TcAttention => "tc_attention",
            KernelPath::Skinny => "skinny",
            KernelPath::LnVec => "ln_vec",
            KernelPath::EwVec => "ew_vec",
            KernelPath::GemmSmall => "gemm_small",
            KernelPath::LnDefer => "ln_defer",
            KernelPath::Pdl => "pdl",
            KernelPath::StagedIo => "staged_io",
            KernelPath::StageFold => "stage_fold",
            KernelPath::InlineInput => "inline_input",
            KernelPath::PollOutput => "poll_output",
            KernelPath::AttnS16 => "attn_s16",
            KernelPath::AttnQ128 => "attn_q128",
            KernelPath::MmResidual => "mm_residual",
            KernelPath::PoolSplit => "pool_split",
        }
    }

    fn bit(self) -> u32 {
        1 << self as u32
    }
}

impl fmt::Display for KernelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KernelPath {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KernelPath::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                let known: Vec<&str> = KernelPath::ALL.iter().map(|p| p.name()).collect();
                format!("unknown kernel path {s:?} (known: {})", known.join(", "))
            })
    }
}

/// Which kernel paths are on: all of them, less those switched off.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct KernelPaths {
    /// Bits of the paths switched off.
    off: u32,
}

impl KernelPaths {
    /// Every path on.
    pub const ALL_ON: KernelPaths = KernelPaths { off: 0 };

    /// These paths also off.
    pub fn without(mut self, paths: &[KernelPath]) -> KernelPaths {
        for p in paths {
            self.off |= p.bit();
        }
        self
    }

    /// Whether `path` is on.
    pub fn on(self, path: KernelPath) -> bool {
        self.off & path.bit() == 0
    }

    /// The paths switched off, in [`KernelPath::ALL`]'s order.
    pub fn off(self) -> Vec<KernelPath> {
        KernelPath::ALL
            .into_iter()
            .filter(|&p| !self.on(p))
            .collect()
    }
}

impl fmt::Debug for KernelPaths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let off: Vec<&str> = self.off().iter().map(|p| p.name()).collect();
        write!(f, "KernelPaths {{ off: {off:?} }}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_list_the_known_ones() {
        for p in KernelPath::ALL {
            assert_eq!(p.name().parse::<KernelPath>(), Ok(p));
            let toml = format!("\"{}\"", p.name());
            let v: KernelPath = toml::from_str::<toml::Value>(&format!("x = {toml}"))
                .unwrap()
                .get("x")
                .unwrap()
                .clone()
                .try_into()
                .unwrap();
            assert_eq!(v, p);
        }
        let err = "small_attn".parse::<KernelPath>().unwrap_err();
        assert!(
            err.contains("small_attn") && err.contains("attn_s16"),
            "{err}"
        );
    }

    #[test]
    fn switching_one_path_off_leaves_the_others_on() {
        let paths = KernelPaths::ALL_ON.without(&[KernelPath::Pdl]);
        assert!(!paths.on(KernelPath::Pdl));
        for p in KernelPath::ALL
            .into_iter()
            .filter(|&p| p != KernelPath::Pdl)
        {
            assert!(paths.on(p), "{p}");
        }
        assert_eq!(paths.off(), vec![KernelPath::Pdl]);
        assert_eq!(KernelPaths::ALL_ON.off(), vec![]);
        let small = KernelPaths::ALL_ON.without(&KernelPath::SMALL_SHAPE);
        assert_eq!(small.off(), KernelPath::SMALL_SHAPE.to_vec());
    }
}
