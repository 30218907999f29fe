#!/usr/bin/env bash
# The GPU check: everything the CUDA backend must show, in one run on a GPU
# machine, with a table at the end. Builds nothing: it runs binaries built
# elsewhere (see scripts/gpu/gpu-carry.sh, which stages them with an f16 copy of
# all-MiniLM-L6-v2 under .carry/).
#
#   scripts/gpu/gpu-check.sh                 # on the GPU machine
#   GPU_CHECK_BACKEND=cpu scripts/gpu/gpu-check.sh   # dry run of the same flow on the CPU backend
#
# Steps: (0) environment; (1) PyTorch baselines and f32 reference embeddings
# computed with sentence-transformers on the very weights we serve; (2) the
# backend check: every bucket on CUDA vs the CPU backend, capture time, graph
# memory, replay+sync latency; (3) the daemon on every GPU with an MLP (f32)
# and MiniLM (f32 and f16): correctness through the daemon against the
# references, every bucketed batch a graph replay, oversize requests eager;
# (4) fault injection under load, with recovery time; (5) with two GPUs: both
# serve identical results, and one faults while the other keeps serving.
# Results: $OUT/gpu-check.md (the table) and JSON beside it.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
BACKEND=${GPU_CHECK_BACKEND:-cuda}
# GPU_CHECK_STEPS=backend stops after the backend check (a quick kernel check).
STEPS=${GPU_CHECK_STEPS:-all}
. scripts/gpu/gpu-common.sh
# Binaries and the f16 MiniLM: given, or as scripts/gpu/gpu-carry.sh staged them.
BIN=$(carried_bin "${GPU_CHECK_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
MODEL=$(carried_minilm_f16 "${GPU_CHECK_MODEL:-}") || { echo "no f16 MiniLM under .carry"; exit 1; }
MLP=tests/data/mlp_seed.safetensors
TEXTS=tests/data/minilm_set_a.jsonl
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export REPLAYD_LOG=${REPLAYD_LOG:-info}
WORK=$(mktemp -d)
FAILED=0
T0=$(date +%s)
log() { echo "[gpu-check +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/gpu-check.log"; }
fail() { log "FAIL: $*"; FAILED=1; }
md() { echo "$*" >> "$OUT/gpu-check.md"; }
: > "$OUT/gpu-check.md"
md "# replayd GPU check"
md ""
md "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)  commit: $(cat .carry/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)  backend: $BACKEND"

# --- 0. environment
if [ "$BACKEND" = cuda ]; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.csv"
  NGPU=$(nvidia-smi -L | wc -l)
  md "GPUs: $NGPU × $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
else
  NGPU=2
fi
md ""

# --- 1. PyTorch baselines and reference embeddings (GPU only)
REF_F32=$TEXTS
if [ "$BACKEND" = cuda ]; then
  log "PyTorch baselines and reference embeddings"
  if PYTHONUNBUFFERED=1 python3 scripts/bench/torch-baseline.py "$MODEL" "$MLP" "$TEXTS" "$OUT" > "$OUT/torch_baseline.log" 2>&1; then
    REF_F32=$OUT/reference_f32.jsonl
  else
    fail "torch baseline (see torch_baseline.log)"; tail -20 "$OUT/torch_baseline.log"
  fi
fi

# --- 2. backend check: every bucket, CUDA vs CPU; latency; capture; memory
cat > "$WORK/models.toml" <<TOML
[[models]]
name = "mlp"
kind = "mlp"
path = "$MLP"
activation = "relu"
dtype = "f32"
batch_buckets = [1, 2, 4, 8, 16, 32, 64, 128]

$(for dt in f32 f16; do
  bert_model "minilm-$dt" "$MODEL" "$dt" padded \
    'batch_buckets = [1, 2, 4, 8, 16, 32, 64, 128]' 'seq_buckets = [16, 32, 64, 128]'
  echo
done)
TOML
if [ "$BACKEND" = cuda ]; then
  log "backend check"
  # The default grid (seq up to 256) for the per-bucket check.
  sed 's/seq_buckets = \[16, 32, 64, 128\]/seq_buckets = [16, 32, 64, 128, 256]/' "$WORK/models.toml" > "$WORK/check.toml"
  # Packed batching: every token budget of the default ladder, in each compute
  # dtype, against the CPU backend (and the f16 one through the references).
  for dt in f16 bf16 f32; do
    { echo; bert_model "minilm-$dt-packed" "$MODEL" "$dt" packed 'max_seqs_per_batch = 256'; } >> "$WORK/check.toml"
    # f32's full ladder alone ran the check past its 400 s bound
    # (2026-12-02, b239445): f32 checks a budget per octave.
    if [ "$dt" = f32 ]; then echo 'token_budgets = [64, 256, 1024, 4096, 16384]' >> "$WORK/check.toml"; fi
  done
  # Bounded: a kernel that never ends (a grid barrier gone wrong) must not
  # eat the whole device session. At 7ee00de the check (300 timed replays a
  # bucket then) ran past 300 s, before its f32 packed ladder; 200 replays
  # give the p50 as well, and the whole script stays inside a 600 s call.
  # BACKEND_CHECK_MODELS="minilm-f32-packed" checks only those models (e.g.
  # a ladder a bounded run did not reach).
  # shellcheck disable=SC2046
  if ! timeout "${BACKEND_CHECK_TIMEOUT:-400}" "$BIN/replayd" backend-check --config "$WORK/check.toml" --out "$OUT/backend_check.json" --iters 200 \
      $([ -n "${BACKEND_CHECK_MODELS:-}" ] && echo --models "$BACKEND_CHECK_MODELS") \
      --profile --reference "minilm-f16-packed=$REF_F32" > "$OUT/backend_check.log" 2>&1; then
    fail "backend check (see backend_check.log)"
  fi
  tail -60 "$OUT/backend_check.log"
  # The packed kernels on synthetic encoders of every head-size class (the
  # backend check covers MiniLM's 32) against the f64 interpreter, and the
  # packed per-step profiles (kernels/NOTES.md lists what to read there).
  if [ -x "$BIN/cuda_selftest" ]; then
    log "cuda_selftest --packed-only"
    if ! "$BIN/cuda_selftest" --packed-only --iters 200 --json "$OUT/cuda_selftest_packed.json" > "$OUT/cuda_selftest_packed.log" 2>&1; then
      fail "cuda_selftest --packed-only (see cuda_selftest_packed.log)"
    fi
    grep -E "FAIL|PROFILE|LAT|RESULT" "$OUT/cuda_selftest_packed.log" | tail -40
  fi
fi

if [ "$STEPS" = backend ]; then
  log "GPU_CHECK_STEPS=backend: stopping after the backend check (failed=$FAILED)"
  exit $FAILED
fi

# --- 3. the daemon
GPUS="all"
cat > "$WORK/replayd.toml" <<TOML
[server]
endpoint = "ipc://$WORK/replayd.sock"
control_endpoint = "ipc://$WORK/control.sock"
runtime_dir = "$WORK/run"

[batching]
max_wait_us = 300

[devices]
backend = "$BACKEND"
gpus = "$GPUS"
cpu_devices = 2
fault_injection = true
restart_backoff_ms = 50

[eager]
workers = 1

$(cat "$WORK/models.toml")
TOML
log "starting replayd ($BACKEND)"
"$BIN/replayd" --config "$WORK/replayd.toml" --ready-file "$WORK/ready.json" > "$OUT/replayd.log" 2>&1 &
DAEMON=$!
if ! wait_ready "$DAEMON" "$WORK/ready.json" 600; then
  fail "replayd did not become ready"; tail -40 "$OUT/replayd.log"; exit 1
fi
log "replayd ready"
CTL=("$BIN/replayctl" --control "ipc://$WORK/control.sock")
LOAD=("$BIN/replayd-loadgen" --endpoint "ipc://$WORK/replayd.sock")
stats() { "${CTL[@]}" stats --json; }
"${CTL[@]}" health

run_load() { # name, expected-ok, args...
  local name=$1; shift
  if "${LOAD[@]}" --json "$OUT/load_$name.json" "$@" > "$OUT/load_$name.log" 2>&1; then
    log "load $name: $(python3 -c "import json;d=json.load(open('$OUT/load_$name.json'));print(d['ok'],'ok', round(d['requests_per_s']),'req/s', 'p50', d['latency_us']['p50'],'us', 'min_cos', d['min_cosine'], 'mlp_err', d['mlp_max_rel_err'], 'devices', d['devices'])")"
  else
    fail "load $name"; tail -5 "$OUT/load_$name.log"
  fi
}
log "correctness through the daemon"
run_load mlp --model mlp --features 128 --verify-mlp "$MLP" --batch 64 --random-batch --concurrency 32 --requests ${N_MLP:-3000} --identical
run_load minilm_f32 --model minilm-f32 --texts "$REF_F32" --min-cosine 0.9999 --batch 8 --random-batch --concurrency 32 --requests ${N_TEXT:-2000} --identical
run_load minilm_f16 --model minilm-f16 --texts "$REF_F32" --min-cosine 0.999 --batch 8 --random-batch --concurrency 32 --requests ${N_TEXT:-2000} --identical
run_load mlp_oversize --model mlp --features 128 --verify-mlp "$MLP" --batch 300 --concurrency 2 --requests 20
stats > "$OUT/stats_after_correctness.json"

# --- 4. fault injection under load
log "fault injection under load"
"${LOAD[@]}" --json "$OUT/load_fault.json" --model minilm-f16 --texts "$REF_F32" --min-cosine 0.999 \
  --batch 4 --random-batch --concurrency 64 --duration ${FAULT_SECONDS:-12} > "$OUT/load_fault.log" 2>&1 &
LOADPID=$!
sleep 3
T_FAULT=$(date +%s.%N)
"${CTL[@]}" inject-fault --device "$( [ "$BACKEND" = cuda ] && echo cuda:0 || echo cpu:0 )" | tee -a "$OUT/gpu-check.log"
RECOVERED=""
for _ in $(seq 1 1200); do
  if stats | python3 -c "import json,sys; d=[x for x in json.load(sys.stdin)['devices'] if x['label'] in ('cuda:0','cpu:0')][0]; sys.exit(0 if d['state']=='ready' and d['device_faults']>=1 else 1)"; then
    RECOVERED=$(python3 -c "import time; print(round(time.time()-$T_FAULT, 2))"); break
  fi
  sleep 0.05
done
wait $LOADPID || fail "load during fault injection had errors (see load_fault.log)"
[ -n "$RECOVERED" ] && log "recovered in ${RECOVERED}s after the fault" || fail "device did not recover"
stats > "$OUT/stats_after_fault.json"

# --- 4b. a hung device under load: a kernel that never ends; the watchdog
# must find the silent worker, kill it and re-run what it held.
log "hang injection under load"
"${LOAD[@]}" --json "$OUT/load_hang.json" --model minilm-f16 --texts "$REF_F32" --min-cosine 0.999 \
  --batch 4 --random-batch --concurrency 64 --duration ${HANG_SECONDS:-10} > "$OUT/load_hang.log" 2>&1 &
LOADPID=$!
sleep 2
T_HANG=$(date +%s.%N)
"${CTL[@]}" inject-fault --kind hang --device "$( [ "$BACKEND" = cuda ] && echo cuda:0 || echo cpu:0 )" | tee -a "$OUT/gpu-check.log"
HANG_RECOVERED=""
for _ in $(seq 1 1200); do
  if stats | python3 -c "import json,sys; d=[x for x in json.load(sys.stdin)['devices'] if x['label'] in ('cuda:0','cpu:0')][0]; sys.exit(0 if d['state']=='ready' and d['hangs']>=1 else 1)"; then
    HANG_RECOVERED=$(python3 -c "import time; print(round(time.time()-$T_HANG, 2))"); break
  fi
  sleep 0.05
done
wait $LOADPID || fail "load during the hang had errors (see load_hang.log)"
[ -n "$HANG_RECOVERED" ] && log "hung device found and back in ${HANG_RECOVERED}s" || fail "hung device not recovered"
echo "$HANG_RECOVERED" > "$OUT/hang_recovered_s.txt"
stats > "$OUT/stats_after_hang.json"

# --- 5. two GPUs: a fault on the second while the first keeps serving
if [ "$NGPU" -ge 2 ]; then
  SECOND=$( [ "$BACKEND" = cuda ] && echo cuda:1 || echo cpu:1 )
  log "second device fault while both serve"
  "${LOAD[@]}" --json "$OUT/load_fault2.json" --model minilm-f32 --texts "$REF_F32" --min-cosine 0.9999 \
    --batch 4 --random-batch --concurrency 64 --duration ${FAULT2_SECONDS:-8} --identical > "$OUT/load_fault2.log" 2>&1 &
  LOADPID=$!
  sleep 2
  "${CTL[@]}" inject-fault --device "$SECOND" | tee -a "$OUT/gpu-check.log"
  wait $LOADPID || fail "load during the second fault had errors (see load_fault2.log)"
  stats > "$OUT/stats_after_fault2.json"
fi

kill -TERM $DAEMON; wait $DAEMON; log "replayd exited with status $?"
stats_file=$OUT/stats_after_fault2.json; [ -f "$stats_file" ] || stats_file=$OUT/stats_after_fault.json

# --- the table
python3 - "$OUT" "$BACKEND" "${RECOVERED:-none}" >> "$OUT/gpu-check.md" <<'PY' || FAILED=1
import json, os, sys
out, backend, recovered = sys.argv[1:4]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
ok = True
s = load("stats_after_correctness.json")
print("## Correctness through the daemon\n")
print("| run | requests ok | errors | stray replies | check | devices |")
print("|---|---|---|---|---|---|")
for name in ["mlp", "minilm_f32", "minilm_f16", "mlp_oversize", "fault", "hang", "fault2"]:
    d = load(f"load_{name}.json")
    if not d:
        continue
    check = []
    if d.get("min_cosine") is not None:
        check.append(f"min cosine {d['min_cosine']:.6f}")
    if d.get("mlp_max_rel_err") is not None:
        check.append(f"max rel err {d['mlp_max_rel_err']:.2e}")
    if d.get("identical_check"):
        ic = d["identical_check"]
        check.append(f"cross-device max diff {ic['max_abs_diff']:g}")
    errs = sum(d["errors"].values())
    ok &= errs == 0 and d["stray_replies"] == 0
    print(f"| {name} | {d['ok']} | {errs} | {d['stray_replies']} | {', '.join(check)} | {d['devices']} |")
print()
if s:
    bucket_batches = sum(b["batches"] for b in s["buckets"])
    graph_devs = [d for d in s["devices"] if d["role"] == "graph"]
    replays = sum(d["graph_replays"] for d in graph_devs)
    eager_runs = sum(d["eager_runs"] for d in s["devices"])
    print(f"Bucketed batches {bucket_batches}, graph replays {replays}, graph-device eager runs "
          f"{sum(d['eager_runs'] for d in graph_devs)}; eager requests {s['eager']['requests']} "
          f"({s['eager']['by_reason']}), eager runs {eager_runs}.\n")
    # Eager texts are batched too (several per run), so runs <= requests;
    # a graph device never runs a bucketed batch eagerly.
    graph_eager = sum(d["eager_runs"] for d in graph_devs)
    ok &= bucket_batches == replays and graph_eager == 0 and eager_runs <= s["eager"]["requests"]
f = load("stats_after_fault.json")
if f:
    print("## Fault injection under load\n")
    for d in f["devices"]:
        print(f"* {d['label']}: state {d['state']}, device faults {d['device_faults']}, restarts {d['restarts']}, "
              f"graphs {len(d['graphs'])}, startup {d['startup_ms']} ms, last error: {d['last_error']}")
    print(f"\nRecovered (fault → ready with every graph re-captured) in {recovered} s.\n")
    if recovered == "none":
        ok = False
dev0 = [d for d in (s or {}).get("devices", []) if d["role"] == "graph"][:1]
if dev0:
    print(f"## Capture time and graph memory ({dev0[0]['label']})\n")
    print("| model | bucket | capture µs | memory MiB |")
    print("|---|---|---|---|")
    for g in dev0[0]["graphs"]:
        print(f"| {g['model']} | {g['bucket']} | {g['capture_us']} | {g['memory_bytes'] / 2**20:.1f} |")
    print()
bc = load("backend_check.json")
tb = load("torch_baseline.json") or {}
if bc:
    print("## Every bucket: CUDA graph vs CPU backend, replay latency (backend check)\n")
    print("Random inputs per bucket, compared with the CPU backend (MLP: max relative error; "
          "MiniLM: min cosine); latency is launch → collect (pinned copy in, replay, copy out, "
          "wait), median of the timed round trips.\n")
    print("| model | bucket | check | capture ms | graph nodes | replay+sync p50 µs | p99 µs | rows/s |")
    print("|---|---|---|---|---|---|---|---|")
    for m in bc["models"]:
        for b in m["buckets"]:
            c = b.get("check") or {}
            lat = b.get("latency") or {}
            v = c.get('value', float('nan'))
            shown = f"{v:.7f}" if c.get('metric') == 'min_cosine' else f"{v:.2e}"
            print(f"| {m['name']} | {b.get('bucket') or str(b['batch']) + 'x' + str(b['seq'])} | {c.get('metric','?')} {shown} "
                  f"{'ok' if c.get('pass') else 'FAIL'} | {b.get('capture_ms', 0):.2f} | {b.get('nodes','')} | "
                  f"{lat.get('median_us', 0):.1f} | {lat.get('p99_us', 0):.1f} | {b.get('throughput_rows_per_s', 0):.0f}"
                  + (f" ({b['throughput_tokens_per_s']:.0f} tokens/s)" if b.get('tokens') else "") + " |")
            ok &= bool(c.get("pass"))
        e = m.get("eager") or {}
        if e:
            ec = e.get("check") or {}
            print(f"| {m['name']} | eager {e.get('batch')}x{e.get('seq')} | {ec.get('metric')} {ec.get('value', float('nan')):.7g} "
                  f"{'ok' if ec.get('pass') else 'FAIL'} | | | | | |")
            ok &= bool(ec.get("pass"))
    ok &= bool(bc.get("pass"))
    print()
    def rd(model, batch, seq):
        for m in bc["models"]:
            if m["name"] == model:
                for b in m["buckets"]:
                    if not b.get("tokens") and (b["batch"], b["seq"]) == (batch, seq):
                        return b["latency"]["median_us"]
    print("## Side by side with PyTorch's own CUDA-graph replay (same call, same GPU)\n")
    print("PyTorch: torch.cuda.CUDAGraph of the same model (MiniLM: the transformers BertModel modules + mean "
          "pooling + L2 normalisation), replay + synchronize with inputs already on the GPU, and "
          "with copies: pinned host batch in, replay, output out to pinned memory, synchronize. "
          "replayd: launch → collect including the host↔device copies.\n")
    print("| shape | replayd p50 µs | PyTorch graph replay p50 µs | PyTorch with copies p50 µs | replayd vs PyTorch with copies |")
    print("|---|---|---|---|---|")
    for label, model, b, sq, key in [("MLP f32 batch 8", "mlp", 8, 1, "mlp_f32_b8"),
                                     ("MiniLM f32 (1, 16)", "minilm-f32", 1, 16, "minilm_f32_1x16"),
                                     ("MiniLM f32 (32, 128)", "minilm-f32", 32, 128, "minilm_f32_32x128"),
                                     ("MiniLM f32 (128, 128)", "minilm-f32", 128, 128, "minilm_f32_128x128"),
                                     ("MiniLM f16 (1, 16)", "minilm-f16", 1, 16, "minilm_f16_1x16"),
                                     ("MiniLM f16 (32, 128)", "minilm-f16", 32, 128, "minilm_f16_32x128"),
                                     ("MiniLM f16 (128, 128)", "minilm-f16", 128, 128, "minilm_f16_128x128")]:
        ours = rd(model, b, sq)
        theirs = (tb.get(key) or {}).get("p50_us")
        copies = ((tb.get(key) or {}).get("with_copies") or {}).get("p50_us")
        ratio = f"{copies / ours:.2f}×" if ours and copies else "n/a"
        r1 = lambda v: v if v is None else round(v, 1)
        print(f"| {label} | {r1(ours)} | {r1(theirs)} | {r1(copies)} | {ratio} |")
    if "baseline_forward_vs_sentence_transformers_min_cosine" in tb:
        print(f"\n(The PyTorch MiniLM forward agrees with sentence-transformers: min cosine "
              f"{tb['baseline_forward_vs_sentence_transformers_min_cosine']:.7f} on 16 texts.)")
    for k in ["st_encode_f32_texts_per_s", "st_encode_f16_texts_per_s"]:
        if k in tb:
            print(f"\nsentence-transformers encode() on the reference texts ×10, batch 128: {k.split('_')[2]} {tb[k]:.0f} texts/s")
    print()
print("\nRESULT:", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
cat "$OUT/gpu-check.md"
[ -f "$OUT/torch_baseline.log" ] && { echo "--- torch_baseline.log (tail)"; tail -15 "$OUT/torch_baseline.log"; }
# The device tool returns at most 8 files: bundle the details.
( cd "$OUT" && tar -czf /tmp/details.tar.gz --exclude gpu-check.md --exclude gpu-check.log . ; \
  find . -maxdepth 1 -type f ! -name gpu-check.md ! -name gpu-check.log -delete; mv /tmp/details.tar.gz . )
rm -rf "$WORK"
exit $FAILED
