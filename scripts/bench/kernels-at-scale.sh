#!/usr/bin/env bash
# Issue 32's benchmark on a GPU machine, in one run: replayd's kernels at
# BERT's sizes against PyTorch's CUDA graph with SDPA attention, and against
# replayd of a baseline build. Builds nothing: it runs the binaries that
# scripts/gpu/gpu-carry.sh stages under .carry/ (with CARRY_BEFORE=REV, that
# revision's build under .carry/before/ too: the baseline); the test folder
# the full-size ones are made from (tests/data/models/bert-st-old) is in git.
#
#   CARRY_BEFORE=REV CARRY_BINS="replayd" scripts/gpu/gpu-carry.sh    # here
#   OUT=dir scripts/bench/kernels-at-scale.sh                          # there, 7–9 minutes
#   (here, with binaries built in this tree: KAS_BIN=target/release; a
#   baseline of your own: KAS_BASE=DIR; none: KAS_BASE=none)
#
# 1. scripts/models/family-models.py make DIR --set scale: random-weight f16
#    folders (numpy only, deterministic), max length 512: minilm-384x6
#    (all-MiniLM-L6-v2's shape), bert-768x12 (BERT-base), bert-1024x24
#    (BERT-large). Meanwhile `replayd precompile` of each build (the kernels,
#    once, so that no step's timeout pays for NVRTC).
# 2. replayd backend-check of this build, a model and a group of shapes a
#    process (one timeout loses one piece): each model twice in its config,
#    padded f16 (batch [1, 8, 32, 128] × seq [16, 128, 512], run through
#    --batches/--seqs as (1, 16); (32, 128), (128, 128); (8, 512), (32, 512))
#    and packed f16 (token budgets 4,096 and 16,384, 256 sequences at most).
#    The served kernel paths only (--no-compare), --no-eager, ITERS (50)
#    timed round trips after WARMUP (10), the CPU reference check on
#    --check-rows rows (1 for BERT-base and -large, 4 for MiniLM; packed:
#    every row of four batches), and --profile of (128, 128), (32, 512) and
#    the packed budgets (both builds).
# 3. PyTorch in the same run (kernels-at-scale.py torch): the same forward
#    in a torch.cuda.CUDAGraph at every padded shape, SDPA first, then eager
#    attention; bounded by TORCH_BUDGET (90 s).
# 4. The baseline build's backend-check, the same groups (no profile).
# 5. The packed budgets, both builds side by side, model by model; BERT-large
#    last (its CPU check of 2 × 16,384 tokens a budget is the slowest step:
#    a time limit that stops the run takes it first).
# 6. BERT-base (padded) once more with `matmul_autotune = true`, if time
#    is left: cuBLASLt's algorithms chosen by timing against its heuristic's.
# 7. The table (kernels-at-scale.py table): per model and shape PyTorch SDPA
#    and eager µs, replayd µs of both builds, the ratio, the change against
#    the baseline, the fraction of the dense f16 peak (PEAK_TFLOPS, else by
#    the GPU's name), the CPU check; the profile's kernel groups; issue 32's
#    targets, PASS/FAIL (informative).
# Bounded: each step has a timeout, the whole run ends by TOTAL_TIMEOUT
# (540 s: a device call's 600 less the table and the bundle) less 15 s; a
# step with no time left is skipped and the table says what was not
# measured. LAYERS=N makes the folders N layers deep (a quick try of the
# flow, not a measurement).
# Results: $OUT/kernels-at-scale.md (the table) and kernels-at-scale.log;
# the rest (JSON reports, logs, configs) in $OUT/details.tar.gz.
# Exit status: 1 when a step failed or a CPU check failed (the speed targets
# are not an exit status).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kernels-at-scale}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin "${KAS_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
BIN=$(cd "$BIN" && pwd)
BASE=""
if [ -n "${KAS_BASE:-}" ]; then
  [ "$KAS_BASE" = none ] || BASE=$(cd "$KAS_BASE" && pwd)
elif [ -f .carry/before/bin.tar.xz ]; then
  BASE=/tmp/replayd-before && mkdir -p "$BASE" && tar -C "$BASE" -xJf .carry/before/bin.tar.xz
fi
PY=${PYTHON:-python3}
FM=scripts/models/family-models.py
KS=scripts/bench/kernels-at-scale.py
ITERS=${ITERS:-50}
WARMUP=${WARMUP:-10}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export REPLAYD_LOG=${REPLAYD_LOG:-info}
WORK=$(mktemp -d)
FAILED=0
T0=$(date +%s)
DEADLINE=$((T0 + ${TOTAL_TIMEOUT:-540} - 15))
log() { echo "[kernels-at-scale +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/kernels-at-scale.log"; }
fail() { log "FAIL: $*"; FAILED=1; }
# left SECONDS: the smaller of SECONDS and the time to the deadline (≥ 1).
left() { local l=$((DEADLINE - $(date +%s))); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo "$l"; }
: > "$OUT/kernels-at-scale.log"
rm -f "$OUT"/bc_*.json "$OUT"/bc_*.log "$OUT/torch.json" "$OUT/details.tar.gz" "$OUT/kernels-at-scale.md"
[ -x "$BIN/replayd" ] || { fail "$BIN/replayd missing (re-run scripts/gpu/gpu-carry.sh)"; exit 1; }
if [ -n "$BASE" ] && [ ! -x "$BASE/replayd" ]; then fail "$BASE/replayd missing: no baseline"; BASE=""; fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,index --format=csv > "$OUT/nvidia-smi.csv" 2>&1
if [ -z "${KAS_BIN:-}" ]; then cp .carry/COMMIT "$OUT/binaries-commit.txt" 2>/dev/null; else
  echo "$KAS_BIN ($(git rev-parse --short HEAD 2>/dev/null))" > "$OUT/binaries-commit.txt"; fi
if [ -n "$BASE" ]; then
  if [ -z "${KAS_BASE:-}" ]; then cp .carry/before/COMMIT "$OUT/baseline-commit.txt" 2>/dev/null || echo "?" > "$OUT/baseline-commit.txt"
  else echo "$KAS_BASE" > "$OUT/baseline-commit.txt"; fi
fi
"$BIN/replayd" --version > "$OUT/versions.txt" 2>&1
[ -n "$BASE" ] && "$BASE/replayd" --version >> "$OUT/versions.txt" 2>&1
log "this build $(tr '\n' ' ' < "$OUT/binaries-commit.txt" 2>/dev/null)($BIN); baseline $([ -n "$BASE" ] && echo "$(tr '\n' ' ' < "$OUT/baseline-commit.txt")($BASE)" || echo none); $(sed -n 2p "$OUT/nvidia-smi.csv")"

NAMES=(minilm-384x6 bert-768x12 bert-1024x24)
SCALE=$WORK/scale
# The configs (no path is read before a model loads, so they come first):
# each model padded and packed.
for n in "${NAMES[@]}"; do
  {
    bert_model "$n" "$SCALE/$n" f16 padded 'batch_buckets = [1, 8, 32, 128]' 'seq_buckets = [16, 128, 512]'
    echo
    bert_model "$n-packed" "$SCALE/$n" f16 packed 'token_budgets = [4096, 16384]' 'max_seqs_per_batch = 256'
  } > "$WORK/$n.toml"
  cp "$WORK/$n.toml" "$OUT/$n.toml"
done

# --- 1. the folders; the kernels of each build compiled meanwhile
pc_pids=()
for tag in new ${BASE:+base}; do
  bin=$BIN; [ "$tag" = base ] && bin=$BASE
  timeout -k 10 "$(left 150)" "$bin/replayd" precompile --config "$WORK/${NAMES[0]}.toml" > "$OUT/precompile_$tag.log" 2>&1 &
  pc_pids+=($!)
done
log "making the scale set (and precompiling ${#pc_pids[@]} build(s))"
if ! timeout -k 10 "$(left 120)" $PY $FM make "$SCALE" --set scale ${LAYERS:+--layers $LAYERS} > "$OUT/family_models_make.log" 2>&1; then
  fail "family-models.py make --set scale (see family_models_make.log)"; tail -5 "$OUT/family_models_make.log"
fi
cp "$SCALE/families.json" "$OUT/" 2>/dev/null || fail "no families.json"
for p in "${pc_pids[@]}"; do
  wait "$p" || log "a precompile failed, rc $? (backend-check compiles what it needs; see precompile_*.log)"
done
log "folders made, kernels compiled"

# The flags a build's backend-check takes (a baseline may predate some).
declare -A HELP
for tag in new ${BASE:+base}; do
  bin=$BIN; [ "$tag" = base ] && bin=$BASE
  HELP[$tag]=$("$bin/replayd" backend-check --help 2>&1)
done
has() { grep -q -- "$2" <<< "${HELP[$1]}"; }

# check TAG MODEL GROUP CAP: one backend-check process, bc_TAG_MODEL_GROUP.json.
check() {
  local tag=$1 n=$2 group=$3 cap=$4 bin=$BIN rows=1 flags=() sel=()
  [ "$tag" = base ] && bin=$BASE
  [ "$n" = minilm-384x6 ] && rows=4
  case $group in
    s16) sel=(--models "$n" --batches 1 --seqs 16) ;;
    s128) sel=(--models "$n" --batches 32,128 --seqs 128) ;;
    s512) sel=(--models "$n" --batches 8,32 --seqs 512) ;;
    packed) sel=(--models "$n-packed") ;;
  esac
  if has "$tag" --no-compare; then flags+=(--no-compare); else flags+=(--fused on); fi
  has "$tag" --warmup && flags+=(--warmup "$WARMUP")
  has "$tag" --check-rows && flags+=(--check-rows "$rows")
  # Both builds profiled (one batch a bucket, after the timing): the kernel
  # groups side by side say which change moved what.
  if [ "$group" != s16 ] && has "$tag" --profile; then
    flags+=(--profile)
    has "$tag" --profile-buckets && flags+=(--profile-buckets 128x128,32x512)
  fi
  local t; t=$(left "$cap")
  local stem=bc_${tag}_${n}_$group
  if [ "$t" -lt 20 ]; then fail "no time left for $stem"; return; fi
  log "backend-check $tag $n $group (timeout ${t}s)"
  timeout -k 10 "$t" "$bin/replayd" backend-check --config "$WORK/$n.toml" "${sel[@]}" --out "$OUT/$stem.json" \
    --iters "$ITERS" --no-eager "${flags[@]}" > "$OUT/$stem.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || fail "backend-check $tag $n $group, rc $rc$([ $rc -eq 124 ] && echo ', timed out') (see $stem.log)"
  grep -E "^$n|ERROR|failed" "$OUT/$stem.log" | grep -v "^ " | head -8
}

# --- 2. this build, padded
for n in "${NAMES[@]}"; do
  check new "$n" s16 90
  check new "$n" s128 90
  check new "$n" s512 90
done

# --- 3. PyTorch, SDPA then eager
t=$(left $(( ${TORCH_BUDGET:-90} + 40 )))
if [ "$t" -lt 30 ]; then fail "no time left for PyTorch"; else
  log "PyTorch CUDA graphs (SDPA, eager; budget ${TORCH_BUDGET:-90} s, timeout ${t}s)"
  timeout -k 10 "$t" $PY $KS torch "$OUT/torch.json" "${NAMES[@]/#/$SCALE/}" --budget-s "${TORCH_BUDGET:-90}" \
    > "$OUT/torch.log" 2>&1 || fail "PyTorch baseline, rc $? (see torch.log)"
  tail -3 "$OUT/torch.log"
fi

# --- 4. the baseline build, padded
if [ -n "$BASE" ]; then
  for n in "${NAMES[@]}"; do
    check base "$n" s16 90
    check base "$n" s128 90
    check base "$n" s512 90
  done
fi

# --- 5. packed, both builds model by model (BERT-large's CPU check last)
for n in "${NAMES[@]}"; do
  check new "$n" packed 150
  [ -n "$BASE" ] && check base "$n" packed 150
done

# --- 6. BERT-base with cuBLASLt's algorithms chosen by timing
# (`matmul_autotune`, off by default): what the heuristic's first choice
# leaves on the table, for the matmul-choice question of issue 32.
n=bert-768x12
{ printf '[devices]\nmatmul_autotune = true\n\n'; cat "$WORK/$n.toml"; } > "$WORK/$n-tuned.toml"
for group in s128 s512; do
  t=$(left 90); stem=bc_tuned_${n}_$group
  if [ "$t" -lt 30 ]; then log "no time left for $stem (skipped)"; continue; fi
  sel=(--batches 32,128 --seqs 128); [ $group = s512 ] && sel=(--batches 8,32 --seqs 512)
  log "backend-check tuned $n $group (timeout ${t}s)"
  timeout -k 10 "$t" "$BIN/replayd" backend-check --config "$WORK/$n-tuned.toml" --models "$n" "${sel[@]}" \
    --out "$OUT/$stem.json" --iters "$ITERS" --warmup "$WARMUP" --no-eager --no-compare --check-rows 1 \
    > "$OUT/$stem.log" 2>&1 || fail "backend-check tuned $n $group, rc $? (see $stem.log)"
done

# --- 7. the table
$PY $KS table "$OUT" > "$OUT/kernels-at-scale.md" 2>>"$OUT/kernels-at-scale.log" || fail "the table (see kernels-at-scale.log)"
# A CPU check that failed in this build's reports is a failure of the run.
$PY - "$OUT" <<'PY' || FAILED=1
import glob, json, sys
bad = []
for p in sorted(glob.glob(f"{sys.argv[1]}/bc_new_*.json")):
    try:
        r = json.load(open(p))
    except Exception as e:
        bad.append(f"{p}: {e}")
        continue
    if not r.get("pass"):
        bad += r.get("failures", [])[:5] or [f"{p}: pass = false"]
for b in bad:
    print("backend-check:", b)
sys.exit(1 if bad else 0)
PY
if [ $FAILED -ne 0 ]; then
  printf '\nA step failed (see kernels-at-scale.log):\n\n' >> "$OUT/kernels-at-scale.md"
  grep 'FAIL:' "$OUT/kernels-at-scale.log" | sed 's/^/* /' >> "$OUT/kernels-at-scale.md"
fi
cat "$OUT/kernels-at-scale.md"
log "done"
# The device tool returns few files: bundle the details.
( cd "$OUT" && tar -czf "$WORK/details.tar.gz" --exclude kernels-at-scale.md --exclude kernels-at-scale.log . && \
  find . -maxdepth 1 -type f ! -name kernels-at-scale.md ! -name kernels-at-scale.log -delete && mv "$WORK/details.tar.gz" . )
rm -rf "$WORK"
exit $FAILED
