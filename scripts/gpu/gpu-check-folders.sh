#!/usr/bin/env bash
# Every bucket of some test folders (tests/data/models) on the CUDA backend
# against the CPU backend, in one GPU call: `replayd backend-check` over the
# folders in f32, f16 and bf16, padded buckets and packed budgets (each
# bucket's graph, and the eager path), with a table at the end. Builds
# nothing: it runs the binaries scripts/gpu/gpu-carry.sh staged in .carry/.
#
#   OUT=dir scripts/gpu/gpu-check-folders.sh [FOLDER...]
#
# Without FOLDER arguments: the families added after gpu-families.sh's list
# (SPLADE, GTE, NomicBERT with and without dynamic NTK, ModernBERT on the
# windowed tensor-core attention), and GTE with its remote code's static NTK rope
# scaling (gte-hub-st with rope_scaling {type: ntk, factor: 2}).
# Results: $OUT/check-folders.md, backend_check.json and .log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-check-folders}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin "${GPU_CHECK_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
PY=${PYTHON:-python3}
MODELS=$(pwd)/tests/data/models
WORK=$(mktemp -d)
FOLDERS=("$@")
if [ ${#FOLDERS[@]} -eq 0 ]; then
  FOLDERS=(splade-st splade-distilbert-st gte-st gte-hub-st nomic-st nomic-hub-st nomic-ntk-hub-st modernbert-st)
  cp -R "$MODELS/gte-hub-st" "$WORK/gte-ntk"
  $PY - "$WORK/gte-ntk/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["rope_scaling"] = {"type": "ntk", "factor": 2.0}
json.dump(c, open(sys.argv[1], "w"), indent=2)
PY
  FOLDERS+=("$WORK/gte-ntk")
fi
[ -f .carry/COMMIT ] && [ -z "${GPU_CHECK_BIN:-}" ] && cp .carry/COMMIT "$OUT/binaries-commit.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
: > "$WORK/check.toml"
for f in "${FOLDERS[@]}"; do
  case $f in /*) path=$f;; *) path=$MODELS/$f;; esac
  name=$(basename "$f")
  for dt in f32 f16 bf16; do
    bert_model "$name-$dt" "$path" "$dt" padded 'batch_buckets = [1, 8]' 'seq_buckets = [16, 64]' >> "$WORK/check.toml"
    bert_model "$name-$dt-packed" "$path" "$dt" packed 'token_budgets = [64, 512]' 'max_seqs_per_batch = 16' >> "$WORK/check.toml"
  done
done
cp "$WORK/check.toml" "$OUT/"
timeout -k 10 "${BACKEND_CHECK_TIMEOUT:-400}" "$BIN/replayd" backend-check --config "$WORK/check.toml" \
  --out "$OUT/backend_check.json" --iters 30 --warmup 5 > "$OUT/backend_check.log" 2>&1
rc=$?
$PY - "$OUT/backend_check.json" > "$OUT/check-folders.md" <<'PY'
import json, sys
try:
    bc = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"no report: {e}\n\nRESULT: FAIL")
    sys.exit(1)
print(f"device: {bc.get('device')}\n")
print("| model | buckets | worst check | worst bucket | eager |")
print("|---|---|---|---|---|")
ok = bool(bc.get("pass"))
for m in bc["models"]:
    worst, wb, bad = None, "", 0
    for b in m["buckets"]:
        c = b.get("check") or {}
        score = c.get("metric") == "max_score_err"
        v = c.get("value", float("nan"))
        bad += not c.get("pass")
        if worst is None or (v > worst if score else v < worst):
            worst, wb = v, str(b.get("bucket"))
    e = (m.get("eager") or {}).get("check") or {}
    ev = f"{e.get('value', float('nan')):.6f} {'ok' if e.get('pass') else 'FAIL'}" if e else ""
    ok &= bad == 0 and (not e or bool(e.get("pass")))
    print(f"| {m['name']} | {len(m['buckets'])}{f' ({bad} FAIL)' if bad else ''} | {worst} | {wb} | {ev} |")
print("\nRESULT:", "PASS" if ok else "FAIL")
PY
cat "$OUT/check-folders.md"
tail -5 "$OUT/backend_check.log"
rm -rf "$WORK"
[ $rc -eq 0 ] && grep -q '^RESULT: PASS' "$OUT/check-folders.md"
