#!/usr/bin/env bash
# Bounded libFuzzer run of every target in fuzz/ (protocol decoder, worker
# link decoder, config parser, tokenizer front), then one line per target:
# executions, seconds, new corpus entries, crashes. Exits non-zero on a crash
# (the input is kept under fuzz/artifacts/TARGET/).
#
#   scripts/dev/fuzz.sh                  # CI: FUZZ_SECONDS=20 per target
#   FUZZ_SECONDS=600 scripts/dev/fuzz.sh # the documented longer run
#
# cargo-fuzz is installed into ~/.cargo/bin if missing. It needs a nightly
# compiler's flags; RUSTC_BOOTSTRAP=1 lets the stable toolchain accept them.
# The committed seeds (fuzz/corpus/TARGET) are read, never written: what the
# run discovers goes to a scratch directory.
set -euo pipefail
cd "$(dirname "$0")/../.."

secs=${FUZZ_SECONDS:-20}
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
scripts/dev/fetch-model.sh # the tokenizer target uses the default model's tokenizer

# No sanitizer: the targets are safe Rust, so libFuzzer's coverage and its
# panic/abort/OOM/timeout detection are what matter, and the build is faster.
cargo fuzz build -O --sanitizer none

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
printf '%-18s %12s %8s %8s %8s\n' target executions seconds new crashes
for target in $(cargo fuzz list); do
    mkdir -p "$scratch/$target"
    log="$scratch/$target.log"
    rc=0
    cargo fuzz run -O --sanitizer none "$target" "$scratch/$target" "fuzz/corpus/$target" -- \
        -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
        >"$log" 2>&1 || rc=$?
    runs=$(grep -oE 'Done [0-9]+ runs' "$log" | grep -oE '[0-9]+' || echo '?')
    new=$(find "$scratch/$target" -type f | wc -l)
    crashes=0
    if [ "$rc" -ne 0 ]; then
        crashes=1
        status=1
        tail -n 40 "$log" >&2
    fi
    printf '%-18s %12s %8s %8s %8s\n' "$target" "$runs" "$secs" "$new" "$crashes"
done
exit $status
