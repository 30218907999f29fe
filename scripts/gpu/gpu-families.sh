#!/usr/bin/env bash
# Issue 13's encoder families on the CUDA backend, in one run on a GPU
# machine, with a table at the end. Builds nothing: it runs binaries built
# elsewhere (scripts/gpu/gpu-carry.sh stages them under .carry/, family_check
# among them); the test folders (tests/data/models) are in git.
#
#   OUT=dir scripts/gpu/gpu-families.sh                          # on the GPU machine
#   GPU_CHECK_BACKEND=cpu OUT=dir scripts/gpu/gpu-families.sh    # dry run on the CPU backend
#
# (a) backend check: every family test folder (XLM-R, MPNet, BERT with
#     include_prompt = false + Dense + Normalize, BERT old layout, and the
#     BERT / XLM-R cross-encoders) in f32, f16 and bf16, padded buckets and
#     packed budgets, each bucket's graph against the CPU backend (min
#     cosine); then full-size random folders of each family
#     (scripts/models/family-models.py make: XLM-R 384×12, MPNet 768×12, a BERT cross-encoder
#     384×6) at (1, 16) and (32, 128), and MPNet packed, in f16 and f32.
# (b) the daemon serving every test folder in f32, f16 and bf16 (padded and
#     packed), its outputs against the folders' committed sentence-transformers
#     references (examples/family_check.rs: texts with their prompts, pairs;
#     cosine >= 0.9999 f32 / 0.999 f16 / 0.99 bf16, scores within 1e-4 f32 /
#     1e-2 f16 / 5e-2 bf16 relative to max(1, |score|)).
# (c) speed: replayd's graph replay (backend check launch -> collect, copies
#     included) of the full-size folders at (1, 16) and (32, 128) in f16
#     against PyTorch's torch.cuda.CUDAGraph replay of the same transformers
#     model in f16 (family-models.py torch).
# With GPU_CHECK_BACKEND=cpu: (a) and the PyTorch timing are skipped (they
# need a GPU); (b) runs on the CPU backend, and (c) only makes two-layer
# full-width folders and serves them once through the daemon.
# Results: $OUT/gpu-families.md (the table), JSON and logs beside it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-families}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BACKEND=${GPU_CHECK_BACKEND:-cuda}
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin "${GPU_CHECK_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
PY=${PYTHON:-python3}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export REPLAYD_LOG=${REPLAYD_LOG:-info}
REPO=$(pwd)
MODELS=$REPO/tests/data/models
FOLDERS=(bert-st-new bert-st-old xlmr-st mpnet-st distilbert-st modernbert-st bert-cross-encoder bert-cross-encoder-legacy bert-cross-encoder-v4 xlmr-cross-encoder)
DTYPES=(f32 f16 bf16)
WORK=$(mktemp -d)
FAILED=0
T0=$(date +%s)
log() { echo "[gpu-families +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/gpu-families.log"; }
fail() { log "FAIL: $*"; FAILED=1; }
: > "$OUT/gpu-families.log"
for b in replayd family_check; do
  [ -x "$BIN/$b" ] || { fail "$BIN/$b missing (re-run scripts/gpu/gpu-carry.sh)"; exit 1; }
done
if [ "$BACKEND" = cuda ]; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
fi

# --- full-size random folders (numpy only; deterministic)
BIG=$WORK/big
if [ "$BACKEND" = cuda ]; then LAYERS=""; else LAYERS="--layers 2"; fi
log "making full-size family folders $LAYERS"
if ! $PY scripts/models/family-models.py make "$BIG" $LAYERS > "$OUT/family_models_make.log" 2>&1; then
  fail "family-models.py make (see family_models_make.log)"; tail -5 "$OUT/family_models_make.log"
fi
cp "$BIG/families.json" "$OUT/" 2>/dev/null

model() {  # name, path, dtype, batching lines
  printf '[[models]]\nname = "%s"\nkind = "bert"\npath = "%s"\ndtype = "%s"\n%s\n\n' "$1" "$2" "$3" "$4"
}
PADDED='batching = "padded"
batch_buckets = [1, 8]
seq_buckets = [16, 64]'
PACKED='batching = "packed"
token_budgets = [64, 512]
max_seqs_per_batch = 16'

# --- (a) backend check (GPU only)
if [ "$BACKEND" = cuda ]; then
  : > "$WORK/check_small.toml"
  for f in "${FOLDERS[@]}"; do
    for dt in "${DTYPES[@]}"; do
      model "$f-$dt" "$MODELS/$f" "$dt" "$PADDED" >> "$WORK/check_small.toml"
      model "$f-$dt-packed" "$MODELS/$f" "$dt" "$PACKED" >> "$WORK/check_small.toml"
    done
  done
  log "backend check: test folders × f32/f16/bf16, padded and packed"
  if ! timeout "${BACKEND_CHECK_TIMEOUT:-150}" "$BIN/replayd" backend-check --config "$WORK/check_small.toml" \
      --out "$OUT/backend_check_families.json" --iters 30 --warmup 5 > "$OUT/backend_check_families.log" 2>&1; then
    fail "backend check of the test folders (see backend_check_families.log)"
  fi
  tail -30 "$OUT/backend_check_families.log"
  : > "$WORK/check_big.toml"
  for fam in xlmr mpnet bert-ce; do
    for dt in f16 f32; do
      model "$fam-$dt" "$BIG/$fam" "$dt" 'batching = "padded"
batch_buckets = [1, 32]
seq_buckets = [16, 128]' >> "$WORK/check_big.toml"
    done
  done
  for dt in f16 bf16; do
    model "mpnet-$dt-packed" "$BIG/mpnet" "$dt" 'batching = "packed"
token_budgets = [256]
max_seqs_per_batch = 8' >> "$WORK/check_big.toml"
  done
  log "backend check: full-size folders (speed, and the tensor-core kernels)"
  if ! timeout "${BACKEND_CHECK_BIG_TIMEOUT:-150}" "$BIN/replayd" backend-check --config "$WORK/check_big.toml" \
      --out "$OUT/backend_check_big.json" --iters 300 --no-eager --batches 1,32 --seqs 16,128 \
      > "$OUT/backend_check_big.log" 2>&1; then
    fail "backend check of the full-size folders (see backend_check_big.log)"
  fi
  tail -30 "$OUT/backend_check_big.log"
  log "PyTorch CUDA-graph replay of the full-size folders (f16)"
  if ! timeout "${TORCH_TIMEOUT:-150}" $PY scripts/models/family-models.py torch "$OUT/torch_families.json" \
      "$BIG/xlmr" "$BIG/mpnet" "$BIG/bert-ce" > "$OUT/torch_families.log" 2>&1; then
    fail "PyTorch timing (see torch_families.log)"; tail -20 "$OUT/torch_families.log"
  fi
fi

# --- (b) the daemon against the sentence-transformers references
{
  printf '[server]\nendpoint = "ipc://%s/replayd.sock"\ncontrol_endpoint = "ipc://%s/control.sock"\nruntime_dir = "%s/run"\n\n' "$WORK" "$WORK" "$WORK"
  printf '[batching]\nmax_wait_us = 300\n\n'
  if [ "$BACKEND" = cuda ]; then
    printf '[devices]\nbackend = "cuda"\ngpus = [0]\n\n'
  else
    printf '[devices]\nbackend = "cpu"\ncpu_devices = 1\n\n'
  fi
  printf '[eager]\nworkers = 1\n\n'
  for f in "${FOLDERS[@]}"; do
    for dt in "${DTYPES[@]}"; do
      model "$f-$dt" "$MODELS/$f" "$dt" "$PADDED"
      model "$f-$dt-packed" "$MODELS/$f" "$dt" "$PACKED"
    done
  done
  for fam in xlmr mpnet bert-ce; do
    model "big-$fam" "$BIG/$fam" f16 'batching = "padded"
batch_buckets = [1]
seq_buckets = [16]'
  done
} > "$WORK/replayd.toml"
log "starting replayd ($BACKEND) with every test folder in f32/f16/bf16"
"$BIN/replayd" --config "$WORK/replayd.toml" --ready-file "$WORK/ready.json" > "$OUT/replayd.log" 2>&1 &
DAEMON=$!
if ! wait_ready "$DAEMON" "$WORK/ready.json"; then
  fail "replayd did not become ready"; tail -40 "$OUT/replayd.log"
else
  log "replayd ready"
  for dt in "${DTYPES[@]}"; do
    case $dt in f32) COS=0.9999; TOL=1e-4;; f16) COS=0.999; TOL=1e-2;; bf16) COS=0.99; TOL=5e-2;; esac
    ARGS=()
    for f in "${FOLDERS[@]}"; do ARGS+=(--model "$f-$dt=$MODELS/$f" --model "$f-$dt-packed=$MODELS/$f"); done
    if ! timeout 120 "$BIN/family_check" --endpoint "ipc://$WORK/replayd.sock" "${ARGS[@]}" --min-cosine $COS \
        --score-tol $TOL --json "$OUT/family_check_$dt.json" > "$OUT/family_check_$dt.log" 2>&1; then
      fail "references through the daemon, $dt (see family_check_$dt.log)"
    fi
    cat "$OUT/family_check_$dt.log"
  done
  # The full-size folders load and answer (their numbers are checked in (a)).
  printf '{"text": "A full-size folder answers."}\n{"text": "Deux phrases de plus."}\n{"text": "and a third"}\n' > "$WORK/texts.jsonl"
  if ! timeout 120 "$BIN/replayd-loadgen" --endpoint "ipc://$WORK/replayd.sock" --model big-mpnet \
      --texts "$WORK/texts.jsonl" --min-cosine 0 --batch 1 --concurrency 1 --requests 3 \
      --json "$OUT/load_big_mpnet.json" > "$OUT/load_big_mpnet.log" 2>&1; then
    fail "full-size MPNet through the daemon (see load_big_mpnet.log)"
  fi
  "$BIN/replayctl" --control "ipc://$WORK/control.sock" stats --json > "$OUT/stats.json" 2>/dev/null
fi
kill -TERM $DAEMON 2>/dev/null; wait $DAEMON 2>/dev/null

# --- the table
$PY - "$OUT" "$BACKEND" > "$OUT/gpu-families.md" <<'PY' || FAILED=1
import json, os, sys
out, backend = sys.argv[1:3]
def load(name):
    p = os.path.join(out, name)
    try:
        return json.load(open(p)) if os.path.exists(p) else None
    except Exception as e:
        print(f"(could not read {name}: {e})")
        return None
ok = True
print("# replayd: issue 13's encoder families\n")
print(f"backend: {backend}\n")
for name, title in [("backend_check_families.json", "(a) Test folders: every bucket's graph vs the CPU backend"),
                    ("backend_check_big.json", "(a) Full-size random folders: graphs vs the CPU backend")]:
    bc = load(name)
    if backend != "cuda":
        continue
    print(f"## {title}\n")
    if not bc:
        print("missing: the backend check did not finish\n")
        ok = False
        continue
    # Embeddings: the least cosine of a row; cross-encoders (one score a
    # row): the largest error relative to max(1, |score|).
    print("| model | buckets | min cosine / max score err | worst bucket | eager |")
    print("|---|---|---|---|---|")
    for m in bc["models"]:
        worst, wb, n, bad = None, "", 0, 0
        for b in m["buckets"]:
            c = b.get("check") or {}
            n += 1
            score = c.get("metric") == "max_score_err"
            v = c.get("value", float("inf") if score else float("-inf")) if c else float("-inf")
            if not c.get("pass"):
                bad += 1
            if worst is None or (v > worst if score else v < worst):
                worst, wb = v, f"{b.get('bucket')}{'' if b.get('served', b.get('fused', True)) else ' (compared paths off)'}"
        worst = 1.0 if worst is None else worst
        e = (m.get("eager") or {}).get("check") or {}
        ev = f"{e.get('value', float('nan')):.6f} {'ok' if e.get('pass') else 'FAIL'}" if e else ""
        ok &= bad == 0 and (not e or bool(e.get("pass")))
        print(f"| {m['name']} | {n}{f' ({bad} FAIL)' if bad else ''} | {worst:.6f} | {wb} | {ev} |")
    ok &= bool(bc.get("pass"))
    print()
print("## (b) Through the daemon vs the sentence-transformers references\n")
print("| model | dtype | rows | min cosine | max score error (rel.) | result |")
print("|---|---|---|---|---|---|")
for dt in ["f32", "f16", "bf16"]:
    fc = load(f"family_check_{dt}.json")
    if not fc:
        print(f"| (all) | {dt} | | | | missing |")
        ok = False
        continue
    for m in fc["models"]:
        mc = m.get("min_cosine")
        se = m.get("max_score_rel_err")
        res = "ok" if m.get("pass") else ("FAIL: " + (m.get("error") or "; ".join(m.get("failures", [])[:2])))
        print(f"| {m['name']} | {dt} | {m.get('rows', 0)} | {'' if mc is None else f'{mc:.6f}'} | "
              f"{'' if se is None else f'{se:.2e}'} | {res} |")
        ok &= bool(m.get("pass"))
    ok &= bool(fc.get("pass"))
print()
if backend == "cuda":
    bc, tb = load("backend_check_big.json"), load("torch_families.json") or {}
    fams = load("families.json") or {}
    print("## (c) Speed: replayd graph replay vs PyTorch CUDA-graph replay, f16\n")
    print("replayd: backend check launch → collect, pinned copies in and out included, median; with "
          "the served kernel paths where a bucket ran twice (`--compare-off`). PyTorch: "
          "torch.cuda.CUDAGraph of the transformers model (encoder + mean pooling + L2 normalisation, "
          "or classifier + sigmoid), replay + synchronize, and with the same copies.\n")
    print("| family | dims | shape | replayd p50 µs | PyTorch replay p50 µs | PyTorch with copies p50 µs | speed-up vs with copies | faster |")
    print("|---|---|---|---|---|---|---|---|")
    def ours(model, b, s):
        for m in (bc or {}).get("models", []):
            if m["name"] == model:
                cands = [x for x in m["buckets"] if not x.get("tokens") and (x["batch"], x["seq"]) == (b, s)]
                cands.sort(key=lambda x: not x.get("served", x.get("fused", True)))
                if cands and cands[0].get("latency"):
                    return cands[0]["latency"].get("median_us")
    for fam in ["xlmr", "mpnet", "bert-ce"]:
        d = fams.get(fam, {})
        dims = f"{d.get('hidden')}×{d.get('layers')}" if d else ""
        for b, s in [(1, 16), (32, 128)]:
            o = ours(f"{fam}-f16", b, s)
            t = tb.get(f"{fam}_f16_{b}x{s}") or {}
            tr, tc = t.get("p50_us"), (t.get("with_copies") or {}).get("p50_us")
            faster = (o is not None and tc is not None and o < tc)
            ok &= faster
            r1 = lambda v: "n/a" if v is None else f"{v:.1f}"
            sp = f"{tc / o:.2f}×" if o and tc else "n/a"
            print(f"| {fam} | {dims} | ({b}, {s}) | {r1(o)} | {r1(tr)} | {r1(tc)} | {sp} | {'yes' if faster else 'NO'} |")
            if t.get("error"):
                print(f"\n(PyTorch {fam} ({b}, {s}) failed: {t['error'].splitlines()[-1]})\n")
    print()
else:
    lb = load("load_big_mpnet.json")
    print("## (c) dry run\n")
    print("Full-size folders made with 2 layers and served once through the daemon on the CPU "
          f"backend (big-mpnet: {lb.get('ok') if lb else 'missing'} requests ok); no timing on the CPU.\n")
    ok &= bool(lb and lb.get("ok", 0) > 0 and sum(lb.get("errors", {}).values()) == 0)
print("RESULT:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
cat "$OUT/gpu-families.md"
# The device tool returns few files: bundle the details.
( cd "$OUT" && tar -czf "$WORK/details.tar.gz" --exclude gpu-families.md --exclude gpu-families.log . && \
  find . -maxdepth 1 -type f ! -name gpu-families.md ! -name gpu-families.log -delete && mv "$WORK/details.tar.gz" . )
rm -rf "$WORK"
exit $FAILED
