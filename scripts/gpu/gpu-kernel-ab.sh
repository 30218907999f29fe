#!/usr/bin/env bash
# Small-shape kernel A/B on a GPU machine, in one call: MiniLM f16 padded
# (1..2, 16..32), f32 (1, 16) and the packed 64- and 256-token budgets
# (f16, bf16), each
# checked against the CPU backend and timed (`replayd backend-check`, replay
# with copies, p50) once per value of AB_SWITCHES, each the kernel paths
# to switch off (`backend-check --paths-off`, e.g. "ln_defer,pdl";
# "default" = none off), then with ncu (when NCU=1) the GPU time of every
# kernel of the (1, 16) graph, one launch at a time, and the registers and
# spills of the small-shape kernels (cuobjdump of the cached cubin).
#
#   OUT=$OUT AB_SWITCHES="default ln_defer attn_s16" NCU=1 scripts/gpu/gpu-kernel-ab.sh
#   OUT=$OUT AB_SWITCHES="default pdl" NCU=1 NCU_SWITCHES=pdl scripts/gpu/gpu-kernel-ab.sh
#                                   # ncu of the (1, 16) graph with pdl off
#
# Binaries and the f16 model come from scripts/gpu/gpu-carry.sh (carry .carry).
# Writes $OUT/kernel-ab.md (one row per bucket and switch) and the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kernel-ab}
mkdir -p "$OUT"
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin) || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
MODEL=$(carried_minilm_f16) || { echo "no f16 MiniLM under .carry"; exit 1; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
ITERS=${ITERS:-300}
CFG=$OUT/check.toml
# f32 on the f16-stored weights: the staged (1, 16) graph whose pooling
# has no deferred LayerNorm (stage_out writes its output).
{
  bert_model minilm-f16 "$MODEL" f16 padded 'batch_buckets = [1, 2]' 'seq_buckets = [16, 32]'
  bert_model minilm-f32 "$MODEL" f32 padded 'batch_buckets = [1]' 'seq_buckets = [16]'
  for dt in f16 bf16; do
    bert_model "minilm-$dt-packed" "$MODEL" "$dt" packed 'token_budgets = [64, 256]' 'max_seqs_per_batch = 64'
  done
} > "$CFG"
FAILED=0
echo "# kernel A/B, $(date -u +%FT%TZ), commit $(cat .carry/COMMIT), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)" > "$OUT/kernel-ab.md"
echo "" >> "$OUT/kernel-ab.md"
echo "| switches off | bucket | kernels+matmuls | replay p50 µs | p99 µs | replay alone p50 µs (no copies) | check (worst; packed: per case) |" >> "$OUT/kernel-ab.md"
echo "|---|---|---|---|---|---|---|" >> "$OUT/kernel-ab.md"
for sw in ${AB_SWITCHES:-default}; do
  tag=${sw//,/-}
  off=()
  if [ "$sw" != default ]; then off=(--paths-off "$sw"); fi
  if ! timeout 240 "$BIN/replayd" backend-check --config "$CFG" --out "$OUT/bc-$tag.json" --iters "$ITERS" \
      "${off[@]}" --no-compare --no-eager --profile --profile-buckets 1x16 > "$OUT/bc-$tag.log" 2>&1; then
    echo "FAIL: backend-check with $sw (see bc-$tag.log)"; FAILED=1
  fi
  python3 - "$OUT/bc-$tag.json" "$sw" >> "$OUT/kernel-ab.md" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"| {sys.argv[2]} | (no json: {e}) | | | | | |"); sys.exit()
for m in d.get("models", []):
    for b in m.get("buckets", []):
        lat, chk = b.get("latency", {}), b.get("check") or {}
        cases = " ".join(f"{c['name']}:{c['check']['value']:.6f}" for c in b.get("cases", []))
        check = f"{chk.get('metric', '')} {chk.get('value', float('nan')):.6f} {'pass' if chk.get('pass') else 'FAIL'}"
        if b.get("error"):
            check = "error: " + b["error"][:80]
        print(f"| {sys.argv[2]} | {m['name']} {b['bucket']} | {b.get('plan_kernels', '')}+{b.get('plan_matmuls', '')} | "
              f"{lat.get('median_us', 0):.1f} | {lat.get('p99_us', 0):.1f} | {(b.get('replay_only') or {}).get('median_us', 0):.1f} | {check} {cases} |")
if d.get("failures"):
    print(f"| {sys.argv[2]} | failures: {'; '.join(d['failures'])[:300]} | | | | | |")
PY
done
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  # One (1, 16) graph, few replays: every kernel node's own GPU time, under
  # NCU_SWITCHES (kernel paths off; unset: none).
  off=()
  if [ -n "${NCU_SWITCHES:-}" ]; then off=(--paths-off "$NCU_SWITCHES"); fi
  timeout 240 ncu --clock-control none --cache-control none --graph-profiling node \
      --metrics gpu__time_duration.sum --csv \
      "$BIN/replayd" backend-check --config "$CFG" --models minilm-f16 --batches 1 --seqs 16 \
      --iters 3 --warmup 1 "${off[@]}" --no-compare --no-eager --check-rows 1 > "$OUT/ncu.csv" 2> "$OUT/ncu.err" || echo "ncu failed (see ncu.err)"
  python3 - "$OUT/ncu.csv" >> "$OUT/kernel-ab.md" <<'PY'
import csv, sys
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
seq = []
with open(sys.argv[1]) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        v = float(r["Metric Value"].replace(",", "")) * scale.get(r.get("Metric Unit", ""), 1e-3)
        seq.append((r["Kernel Name"], r.get("Grid Size", ""), v))
# The graph's kernels, in order: the last replay's (one launch per node).
print("\n## ncu: GPU time of each kernel of the last (1, 16) replay, µs (alone, no overlap)\n")
print("| # | kernel | grid | µs |")
print("|---|---|---|---|")
n = 0
for i in range(len(seq) - 1, -1, -1):
    n += 1
    if seq[i][0].startswith(("embed", "stage_in")):
        break
for k, (name, grid, v) in enumerate(seq[-n:]):
    print(f"| {k} | {name[:40]} | {grid} | {v:.2f} |")
print(f"\nsum {sum(v for _, _, v in seq[-n:]):.1f} µs over {n} kernels")
PY
  cubin=$(ls -t ~/.cache/replayd/kernels/*.cubin 2>/dev/null | head -1)
  if [ -n "$cubin" ] && command -v cuobjdump >/dev/null; then
    { echo; echo "## registers and spills (cuobjdump -res-usage)"; echo; echo '```';
      cuobjdump -res-usage "$cubin" 2>&1 | grep -A1 -E "gemm_small|attention_tc_f16_d32|embed_ln_vec_f16|pool_f16|pool_ln_f16|pool_packed_ln_f16" | grep -v "^--" | paste - - | sed -E 's/\s+/ /g' | head -24;
      echo '```'; } >> "$OUT/kernel-ab.md"
  fi
fi
cat "$OUT/kernel-ab.md"
for f in "$OUT"/bc-*.log; do echo "== $f"; grep -E "PROFILE|FAIL|fail|min cos|1x16|64t|p50" "$f" | head -40; done
exit $FAILED
