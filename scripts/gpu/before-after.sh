#!/usr/bin/env bash
# Before/after on a GPU machine, in one call: the same grid's every bucket
# through `replayd backend-check` with two builds, the one before a change
# (.carry/before/bin.tar.xz) and the one after it (.carry/bin.tar.xz),
# alternated ROUNDS times on the same GPU (before, after, before, after),
# each bucket checked against the CPU backend. Writes $OUT/before-after.md:
# a row per bucket with both builds' checks, their best replay p50 (launch
# to collect, copies included) and the ratio after/before, and flags a
# bucket whose check fails or that is slower beyond NOISE (default 3 %).
#
#   CARRY_BEFORE=2dead66 CARRY_BINS="replayd replayctl" scripts/gpu/gpu-carry.sh  # here: both builds
#   OUT=$OUT ROUNDS=2 scripts/gpu/before-after.sh       # there, in the repo root
#
# ITERS (default 100) timed replays a bucket; BA_CONFIG a config of your own
# instead of the default grid below (MiniLM f16 padded and packed, f32
# padded, bf16 packed, the seed MLP). A build's backend-check runs with its
# served kernel paths only (`--no-compare`; builds before issue 31 take
# `--fused on`).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/before-after}
mkdir -p "$OUT"
ROUNDS=${ROUNDS:-2}
ITERS=${ITERS:-100}
NOISE=${NOISE:-0.03}
. scripts/gpu/gpu-common.sh
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -f .carry/before/bin.tar.xz ] || { echo "no .carry/before/bin.tar.xz (CARRY_BEFORE=REV scripts/gpu/gpu-carry.sh)"; exit 1; }
AFTER=$(carried_bin) || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
BEFORE=/tmp/replayd-bin-before
mkdir -p "$BEFORE" && tar -C "$BEFORE" -xJf .carry/before/bin.tar.xz
MODEL=$(carried_minilm_f16) || { echo "no f16 MiniLM under .carry"; exit 1; }
CFG=${BA_CONFIG:-$OUT/before-after.toml}
if [ -z "${BA_CONFIG:-}" ]; then
  {
    printf '[[models]]\nname = "mlp"\nkind = "mlp"\npath = "tests/data/mlp_seed.safetensors"\n'
    printf 'activation = "relu"\ndtype = "f32"\nbatch_buckets = [1, 8, 64]\n\n'
    bert_model minilm-f16 "$MODEL" f16 padded 'batch_buckets = [1, 2, 8, 32, 128]' 'seq_buckets = [16, 32, 128, 256]'
    echo
    bert_model minilm-f32 "$MODEL" f32 padded 'batch_buckets = [1, 32]' 'seq_buckets = [16, 128]'
    echo
    bert_model minilm-f16-packed "$MODEL" f16 packed 'token_budgets = [64, 256, 1024, 4096, 16384]' 'max_seqs_per_batch = 256'
    echo
    bert_model minilm-bf16-packed "$MODEL" bf16 packed 'token_budgets = [64, 1024]' 'max_seqs_per_batch = 256'
  } > "$CFG"
fi
run() { # build-dir tag
  local bin=$1 tag=$2 flags=(--no-compare)
  "$bin/replayd" backend-check --help 2>/dev/null | grep -q -- --no-compare || flags=(--fused on)
  if ! timeout 280 "$bin/replayd" backend-check --config "$CFG" --out "$OUT/$tag.json" --iters "$ITERS" \
      --no-eager "${flags[@]}" > "$OUT/$tag.log" 2>&1; then
    echo "backend-check $tag failed (see $tag.log)"; tail -20 "$OUT/$tag.log"
  fi
}
for r in $(seq 1 "$ROUNDS"); do
  run "$BEFORE" "before-$r"
  run "$AFTER" "after-$r"
done
python3 - "$OUT" "$ROUNDS" "$NOISE" "$(cat .carry/before/COMMIT 2>/dev/null)" "$(cat .carry/COMMIT 2>/dev/null)" > "$OUT/before-after.md" <<'PY'
import json, sys
out, rounds, noise, c_before, c_after = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5]
def load(tag):
    runs = {}
    for r in range(1, rounds + 1):
        try:
            d = json.load(open(f"{out}/{tag}-{r}.json"))
        except Exception:
            continue
        for m in d.get("models", []):
            for b in m.get("buckets", []):
                key = (m["name"], b["bucket"])
                chk = b.get("check") or {}
                cur = runs.setdefault(key, {"p50": [], "check": None, "error": None})
                cur["p50"].append(b.get("latency", {}).get("median_us", 0.0))
                if b.get("error"):
                    cur["error"] = b["error"][:60]
                if chk and (cur["check"] is None or not chk.get("pass")):
                    cur["check"] = (chk.get("metric"), chk.get("value"), chk.get("pass"))
    return runs
before, after = load("before"), load("after")
print(f"# before/after: {c_before.split()[0] if c_before else '?'} → {c_after.split()[0] if c_after else '?'}, {rounds} rounds, best p50 of each\n")
print("| model | bucket | check before | check after | p50 before µs | p50 after µs | after/before | |")
print("|---|---|---|---|---|---|---|---|")
bad = 0
for key in sorted(set(before) | set(after)):
    b, a = before.get(key), after.get(key)
    def chk(x):
        if not x: return "missing"
        if x["error"]: return "error: " + x["error"]
        c = x["check"]
        return f"{c[0]} {c[1]:.6f} {'ok' if c[2] else 'FAIL'}" if c else "-"
    pb = min(b["p50"]) if b and b["p50"] else 0.0
    pa = min(a["p50"]) if a and a["p50"] else 0.0
    ratio = pa / pb if pb > 0 and pa > 0 else float("nan")
    flag = ""
    if not a or a["error"] or (a["check"] and not a["check"][2]):
        flag = "CHECK"
    elif ratio == ratio and ratio > 1 + noise:
        flag = "SLOWER"
    bad += bool(flag)
    print(f"| {key[0]} | {key[1]} | {chk(b)} | {chk(a)} | {pb:.1f} | {pa:.1f} | {ratio:.3f} | {flag} |")
print(f"\n{bad} bucket(s) flagged (a failed check, or slower than before by more than {noise:.0%}).")
PY
cat "$OUT/before-after.md"
grep -q "^0 bucket" "$OUT/before-after.md"
