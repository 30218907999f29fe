#!/usr/bin/env bash
# Issue 34 on a GPU machine, in one call: the decoder embedding models
# (Qwen3-Embedding, EmbeddingGemma) checked and timed. Builds nothing: it runs
# the binaries scripts/gpu/gpu-carry.sh staged in .carry/, and makes its
# full-size models there (scripts/models/decoder-models.py, torch and
# transformers on that machine).
#
#   OUT=dir [STAGES="1 2 3 4"] scripts/gpu/gpu-decoders.sh
#
# STAGES picks the parts below (all by default; a device call is limited to
# 10 minutes, so the full run may take two calls: "1 2" and "3 4").
#
# 1. The test folders qwen3-st and gemma3-st (tests/data/models): every
#    padded bucket and packed budget, in f32, f16 (Qwen3 only: Gemma refuses
#    f16) and bf16, on the CUDA backend against the CPU backend
#    (`replayd backend-check`).
# 2. Full-size random models: Qwen3-Embedding-0.6B's and EmbeddingGemma-300m's
#    shapes in bf16 (decoder-models.py make), sentence-transformers' bf16
#    embeddings of 48 texts of natural lengths as references; backend-check
#    over packed budgets 1,024 / 4,096 / 16,384 and padded (1|32) × (16|128|512):
#    each graph against the CPU backend and the references through the
#    graphs, timed with copies.
# 3. transformers with SDPA in bf16 on the same models (decoder-models.py
#    torch-speed): eager and CUDA-graph p50 at (1, 16), (32, 128), (128, 128)
#    and (8, 2048).
# 4. The daemon on qwen3-0.6b with dtype "auto" (bf16 expected), while a
#    Python process holds all but 6 GiB of the GPU: the memory budget must
#    drop the 262,144-token budget (logged with the numbers) and serve the
#    rest; replayctl devices shows the memory per model. replayd-loadgen:
#    short queries one at a time (p50 end to end), natural texts, and
#    two documents of ~23,000 tokens (past every graph: the eager path),
#    each checked against sentence-transformers' bf16 embedding.
# Results: $OUT/decoders.md (the tables) and decoders.log; JSON and logs beside.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-decoders}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin "${GPU_CHECK_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
BIN=$(cd "$BIN" && pwd)
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export REPLAYD_LOG=${REPLAYD_LOG:-info}
PY=${PYTHON:-python3}
DM=scripts/models/decoder-models.py
MODELS=$(pwd)/tests/data/models
# WORK_DIR: keep the full-size models and references there for a later
# call on the same (warm) machine; made only when missing.
WORK=${WORK_DIR:-$(mktemp -d)}
mkdir -p "$WORK"
FAILED=0
STAGES=" ${STAGES:-1 2 3 4} "
stage() { case "$STAGES" in *" $1 "*) return 0;; *) return 1;; esac; }
T0=$(date +%s)
log() { echo "[gpu-decoders +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/decoders.log"; }
fail() { log "FAIL: $*"; FAILED=1; }
: > "$OUT/decoders.log"
[ -f .carry/COMMIT ] && [ -z "${GPU_CHECK_BIN:-}" ] && cp .carry/COMMIT "$OUT/binaries-commit.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
"$BIN/replayd" precompile > "$OUT/precompile.log" 2>&1 || true

# --- 1. the test folders against the CPU backend
if stage 1; then
: > "$WORK/small.toml"
for f in qwen3-st gemma3-st; do
  for dt in f32 f16 bf16; do
    [ "$f" = gemma3-st ] && [ "$dt" = f16 ] && continue
    bert_model "$f-$dt" "$MODELS/$f" "$dt" padded 'batch_buckets = [1, 8]' 'seq_buckets = [16, 64]' >> "$WORK/small.toml"
    bert_model "$f-$dt-packed" "$MODELS/$f" "$dt" packed 'token_budgets = [64, 512]' 'max_seqs_per_batch = 16' >> "$WORK/small.toml"
  done
done
log "1. test folders: backend-check"
timeout -k 10 300 "$BIN/replayd" backend-check --config "$WORK/small.toml" --out "$OUT/check_small.json" \
  --iters 20 --warmup 3 > "$OUT/check_small.log" 2>&1 || fail "backend-check of the test folders (check_small.log)"
tail -3 "$OUT/check_small.log" | tee -a "$OUT/decoders.log"
fi

# --- 2. full-size models
FULL=$WORK/full
if stage 2 || stage 3 || stage 4; then
if [ ! -f "$WORK/ref_embeddinggemma-300m.jsonl" ]; then
log "2. making the full-size models"
timeout -k 10 400 $PY $DM make "$FULL" > "$OUT/make.log" 2>&1 || { fail "decoder-models.py make"; tail -5 "$OUT/make.log"; }
for m in qwen3-0.6b embeddinggemma-300m; do
  timeout -k 10 300 $PY $DM reference "$FULL/$m" "$WORK/ref_$m.jsonl" bfloat16 48 natural >> "$OUT/reference.log" 2>&1 \
    || fail "reference $m"
done
fi
if stage 4 && [ ! -f "$WORK/long.jsonl" ]; then
  timeout -k 10 300 $PY $DM reference "$FULL/qwen3-0.6b" "$WORK/short.jsonl" bfloat16 64 short >> "$OUT/reference.log" 2>&1 || fail "reference short"
  timeout -k 10 300 $PY $DM reference "$FULL/qwen3-0.6b" "$WORK/long.jsonl" bfloat16 2 long >> "$OUT/reference.log" 2>&1 || fail "reference long"
fi
tail -5 "$OUT/reference.log" 2>/dev/null
fi
if stage 2; then
: > "$WORK/full.toml"
for m in qwen3-0.6b embeddinggemma-300m; do
  bert_model "$m" "$FULL/$m" bf16 packed 'token_budgets = [1024, 4096, 16384]' 'max_seqs_per_batch = 128' >> "$WORK/full.toml"
  bert_model "$m-padded" "$FULL/$m" bf16 padded 'batch_buckets = [1, 32]' 'seq_buckets = [16, 128, 512]' >> "$WORK/full.toml"
done
log "2. full-size: backend-check"
timeout -k 10 600 "$BIN/replayd" backend-check --config "$WORK/full.toml" --out "$OUT/check_full.json" \
  --iters 30 --warmup 5 --check-rows 2 --no-compare \
  --reference "qwen3-0.6b=$WORK/ref_qwen3-0.6b.jsonl" --reference "qwen3-0.6b-padded=$WORK/ref_qwen3-0.6b.jsonl" \
  --reference "embeddinggemma-300m=$WORK/ref_embeddinggemma-300m.jsonl" --reference "embeddinggemma-300m-padded=$WORK/ref_embeddinggemma-300m.jsonl" \
  > "$OUT/check_full.log" 2>&1 || fail "backend-check of the full-size models (check_full.log)"
tail -3 "$OUT/check_full.log" | tee -a "$OUT/decoders.log"
fi

# --- 3. transformers with SDPA
if stage 3; then
log "3. transformers (SDPA, bf16)"
timeout -k 10 400 $PY $DM torch-speed "$OUT/torch_speed.json" "$FULL/qwen3-0.6b" "$FULL/embeddinggemma-300m" > "$OUT/torch_speed.log" 2>&1 \
  || fail "torch-speed (torch_speed.log)"
fi

# --- 4. the daemon under a memory squeeze
if stage 4; then
log "4. daemon: qwen3-0.6b, dtype auto, 6 GiB left free by a hog"
rm -f "$WORK/hog.ready"
$PY - "$WORK/hog.ready" <<'PY' > "$OUT/hog.log" 2>&1 &
import sys, time, torch
free, total = torch.cuda.mem_get_info()
keep = 6 << 30
x = torch.empty(max(0, free - keep), dtype=torch.uint8, device="cuda")
open(sys.argv[1], "w").write(f"{free} {x.numel()}\n")
time.sleep(900)
PY
HOG=$!
for _ in $(seq 1 300); do [ -f "$WORK/hog.ready" ] && break; sleep 0.2; done
cat "$WORK/hog.ready" >> "$OUT/decoders.log" 2>/dev/null
cat > "$WORK/daemon.toml" <<TOML
[server]
endpoint = "ipc://$WORK/replayd.sock"
control_endpoint = "ipc://$WORK/control.sock"

[batching]
max_wait_us = 50

[eager]
workers = 1

[[models]]
name = "qwen3"
kind = "bert"
path = "$FULL/qwen3-0.6b"
batching = "packed"
token_budgets = [64, 256, 1024, 4096, 16384, 262144]
max_seqs_per_batch = 128
TOML
rm -f "$WORK/ready.json"
"$BIN/replayd" --config "$WORK/daemon.toml" --ready-file "$WORK/ready.json" > "$OUT/daemon.log" 2>&1 &
DAEMON=$!
if wait_ready "$DAEMON" "$WORK/ready.json" 900; then
  log "daemon ready"
  CTL=("$BIN/replayctl" --control "ipc://$WORK/control.sock")
  LOAD=("$BIN/replayd-loadgen" --endpoint "ipc://$WORK/replayd.sock" --model qwen3 --timeout 300)
  grep -i "bucket dropped\|no graph for" "$OUT/daemon.log" | head -5 | tee -a "$OUT/decoders.log"
  grep -qi "bucket dropped" "$OUT/daemon.log" || fail "the memory budget dropped no bucket"
  "${CTL[@]}" devices > "$OUT/devices.txt" 2>&1; cat "$OUT/devices.txt" >> "$OUT/decoders.log"
  "${CTL[@]}" stats --json > "$OUT/stats_start.json" 2>&1
  grep -o '"dtype": *"[a-z0-9]*"' "$OUT/stats_start.json" | head -2 | tee -a "$OUT/decoders.log"
  run() { local name=$1; shift
    if timeout -k 10 300 "${LOAD[@]}" --json "$OUT/load_$name.json" "$@" > "$OUT/load_$name.log" 2>&1; then
      log "load $name: $($PY -c "import json;d=json.load(open('$OUT/load_$name.json'));print(d['ok'],'ok', round(d['requests_per_s'],1),'req/s','p50',d['latency_us']['p50'],'us p99',d['latency_us']['p99'],'us min_cos',d['min_cosine'])")"
    else fail "load $name"; tail -5 "$OUT/load_$name.log"; fi
  }
  run short --texts "$WORK/short.jsonl" --min-cosine 0.999 --batch 1 --concurrency 1 --requests 1500 --warmup 0.5
  run natural --texts "$WORK/ref_qwen3-0.6b.jsonl" --min-cosine 0.999 --batch 8 --random-batch --concurrency 16 --requests 400
  run long --texts "$WORK/long.jsonl" --min-cosine 0.999 --batch 1 --concurrency 1 --requests 4
  "${CTL[@]}" stats --json > "$OUT/stats_end.json" 2>&1
  kill "$DAEMON"; wait "$DAEMON" 2>/dev/null
else
  fail "the daemon did not become ready"; tail -30 "$OUT/daemon.log"
fi
kill "$HOG" 2>/dev/null; wait "$HOG" 2>/dev/null
fi

# --- the tables
$PY - "$OUT" "$STAGES" > "$OUT/decoders.md" <<'PY'
import json, os, sys
out = sys.argv[1]
stages = sys.argv[2].split()
def load(n):
    try:
        return json.load(open(os.path.join(out, n)))
    except Exception as e:
        return {"error": str(e)}
ok = True
for stage, name in (("1", "check_small.json"), ("2", "check_full.json")):
    if stage not in stages:
        continue
    bc = load(name)
    print(f"## {name} ({bc.get('device')})\n")
    if "models" not in bc:
        print(f"no report: {bc}\n"); ok = False; continue
    print("| model | buckets | worst CPU check | reference (min cosine) | p50 µs (bucket) |")
    print("|---|---|---|---|---|")
    for m in bc["models"]:
        worst, bad, times = None, 0, []
        for b in m["buckets"]:
            c = b.get("check") or {}
            v = c.get("value")
            bad += not c.get("pass")
            if v is not None and (worst is None or v < worst):
                worst = v
            p50 = (b.get("latency") or {}).get("median_us")
            if p50:
                times.append(f"{round(p50)} ({b.get('bucket')})")
        ref = (m.get("reference") or {}).get("check") or {}
        rv = ref.get("value")
        ok &= bad == 0 and (not ref or bool(ref.get("pass", True)))
        print(f"| {m['name']} | {len(m['buckets'])}{f' ({bad} FAIL)' if bad else ''} | {worst} | {rv} | {', '.join(times)} |")
    ok &= bool(bc.get("pass"))
    print()
ts = load("torch_speed.json") if "3" in stages else {}
print(f"## transformers SDPA bf16 ({ts.get('gpu')}, torch {ts.get('torch')})\n")
print("| shape | eager p50 µs | CUDA graph p50 µs (with copies) |")
print("|---|---|---|")
for k, v in ts.items():
    if isinstance(v, dict):
        g = (v.get("graph") or {}).get("with_copies", {}).get("p50_us")
        print(f"| {k} | {v.get('eager_p50_us')} | {g} |")
print()
for n in ("short", "natural", "long") if "4" in stages else ():
    d = load(f"load_{n}.json")
    if "ok" in d:
        print(f"load {n}: {d['ok']} ok, {d.get('errors', 0)} errors, p50 {d['latency_us']['p50']} µs, p99 {d['latency_us']['p99']} µs, min cosine {d['min_cosine']}")
    else:
        ok = False
        print(f"load {n}: {d}")
print("\nRESULT:", "PASS" if ok else "FAIL")
PY
cat "$OUT/decoders.md"
tar -C "$WORK" -czf "$OUT/details.tar.gz" daemon.toml small.toml full.toml 2>/dev/null
[ -z "${WORK_DIR:-}" ] && rm -rf "$WORK"
[ $FAILED -eq 0 ] && grep -q '^RESULT: PASS' "$OUT/decoders.md"
