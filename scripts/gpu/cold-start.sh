#!/usr/bin/env bash
# Cold start on a GPU machine, in one call: seconds from `replayd serve` to
# ready (its --ready-file written) on the default config (MiniLM, f16 copy)
# with an empty kernel cache, for a build that carries its kernels
# (REPLAYD_EMBED_KERNELS, .carry/embedded/) and one that compiles them with
# NVRTC (.carry/bin.tar.xz); then that build again with the cache warm and
# with the cache file corrupted (it must start, warn and recompile); and
# twelve models with the embedding build. Writes $OUT/cold-start.md and each
# run's log.
#
#   CARRY_EMBEDDED=90 CARRY_BINS="replayd replayctl" scripts/gpu/gpu-carry.sh   # here
#   OUT=$OUT scripts/gpu/cold-start.sh                                          # there
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cold-start}
mkdir -p "$OUT"
. scripts/gpu/gpu-common.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
PLAIN=$(carried_bin) || { echo "no .carry/bin.tar.xz (scripts/gpu/gpu-carry.sh)"; exit 1; }
EMBEDDED=/tmp/replayd-bin-embedded
[ -f .carry/embedded/bin.tar.xz ] || { echo "no .carry/embedded (CARRY_EMBEDDED=ARCHS scripts/gpu/gpu-carry.sh)"; exit 1; }
mkdir -p "$EMBEDDED" && tar -C "$EMBEDDED" -xJf .carry/embedded/bin.tar.xz
MODEL=$(carried_minilm_f16) || { echo "no f16 MiniLM under .carry"; exit 1; }

# config MODELS CACHE_DIR: the default config, its model the f16 copy
# (MODELS copies of it), a free port, its own runtime and cache directories.
config() {
  local models=$1 cache=$2 run
  run=$(mktemp -d)
  sed -e 's|^endpoint = .*|endpoint = "tcp://127.0.0.1:0"|' \
      -e "s|^# runtime_dir = .*|runtime_dir = \"$run\"|" \
      -e "s|^# kernel_cache_dir = .*|kernel_cache_dir = \"$cache\"|" \
      config/replayd.toml | awk '/^\[\[models\]\]/{exit} {print}'
  for i in $(seq 1 "$models"); do
    printf '\n[[models]]\nname = "minilm-%s"\nkind = "bert"\npath = "%s"\ndtype = "auto"\n' "$i" "$MODEL"
    printf 'batch_buckets = [1, 2, 4, 8, 16, 32, 64, 128]\nseq_buckets = [16, 32, 64, 128, 256]\nmax_seqs_per_batch = 256\n'
  done
}

# start TAG BIN MODELS CACHE_DIR: seconds to ready, or FAILED.
start() {
  local tag=$1 bin=$2 models=$3 cache=$4 cfg="$OUT/$1.toml" ready="$OUT/$1.ready"
  config "$models" "$cache" > "$cfg"
  rm -f "$ready"
  local t0 t1 pid
  t0=$(date +%s.%N)
  "$bin/replayd" --config "$cfg" --ready-file "$ready" > "$OUT/$tag.log" 2>&1 &
  pid=$!
  while [ ! -f "$ready" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.02; done
  t1=$(date +%s.%N)
  if [ -f "$ready" ]; then
    python3 -c "print(f'{$t1 - $t0:.2f}')"
  else
    echo FAILED
  fi
  kill -TERM "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
}

kernel_line() { grep -o 'kernels \(embedded\|compiled\|loaded\)[^(]*' "$OUT/$1.log" | head -1; }

cache=$(mktemp -d)
rows=()
row() { rows+=("| $1 | $2 | $3 |"); }
t=$(start embedded-empty "$EMBEDDED" 1 "$cache/a"); row "embedded cubins, empty cache" "$t" "$(kernel_line embedded-empty)"
t=$(start nvrtc-empty "$PLAIN" 1 "$cache/b"); row "NVRTC, empty cache" "$t" "$(kernel_line nvrtc-empty)"
t=$(start nvrtc-warm "$PLAIN" 1 "$cache/b"); row "NVRTC build, warm cache" "$t" "$(kernel_line nvrtc-warm)"
f=$(ls "$cache"/b/replayd-kernels-* | head -1)
python3 - "$f" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
for i in range(len(b) // 2, len(b) // 2 + 64):
    b[i] ^= 0x5A
open(p, "wb").write(bytes(b))
PY
t=$(start nvrtc-corrupt "$PLAIN" 1 "$cache/b")
warned=$(grep -c 'is truncated or corrupted' "$OUT/nvrtc-corrupt.log")
row "NVRTC build, corrupted cache file" "$t" "$(kernel_line nvrtc-corrupt); warnings: $warned"
t=$(start embedded-12 "$EMBEDDED" 12 "$cache/c"); row "embedded cubins, twelve models" "$t" "$(kernel_line embedded-12)"
{
  echo "# cold start: $(cat .carry/COMMIT 2>/dev/null | head -1), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(nproc) CPUs"
  echo
  echo "| run | seconds to ready | kernels |"
  echo "|---|---|---|"
  printf '%s\n' "${rows[@]}"
} > "$OUT/cold-start.md"
cat "$OUT/cold-start.md"
grep -h 'compiling the kernels\|kernels embedded\|kernels compiled\|kernels loaded\|corrupted' "$OUT"/*.log | cut -c1-220
