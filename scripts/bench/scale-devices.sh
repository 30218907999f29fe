#!/usr/bin/env bash
# The scaling benchmark of issue 35, in one run on a GPU machine: does the
# host path keep N devices busy? Builds nothing: it runs the binaries and
# the f16 all-MiniLM-L6-v2 that scripts/gpu/gpu-carry.sh stages under .carry/
# (and, with CARRY_BEFORE, the binaries of an earlier commit under
# .carry/before/, run beside the current ones as the baseline).
#
#   scripts/bench/scale-devices.sh        # on the GPU machine, about 6 minutes
#   SCALE_GPU=0 SCALE_SECONDS=4 SCALE_DEVICES="1 2" scripts/bench/scale-devices.sh
#                                         # a smoke run without a GPU (null devices of a
#                                         # made-up time table; CI-sized machines)
#
# Steps, most important first (a time limit that stops the run leaves the
# table of what ran):
# 1. `replayd backend-check --out` on the GPU: each packed MiniLM f16
#    bucket's launch → collect time, the table the simulated devices use
#    (`devices.null_timings`). Without a GPU, a table scaled from token slots.
# 2. Zero-time devices (null backend, 8 devices that take no time): the
#    host path's ceiling at 1 and at 32 texts per request, current binary
#    and baseline.
# 3. Simulated H200s running MiniLM (null devices sleeping each bucket's
#    measured time): 1, 8, 2 and 4 devices at 1 and 32 texts per request:
#    texts/s and the ratio to one device; the baseline binary at 8 devices.
# 4. 8 simulated devices at 80 % of step 3's rate, open loop
#    (`replayd-loadgen --rate`): p50/p99.
# 5. Several workers on the one GPU (`devices.workers_per_gpu` 1, 2, 4), the
#    corpus 32 texts per request: texts/s. Then with 4 workers, one worker
#    killed (SIGKILL) under that load: errors (must be 0), p99 and max
#    latency of the window around the fault, and when the worker was back.
# Every load reports p50/p99 and each thread group's CPU
# (scripts/bench/thread-cpu.py). The corpus: lognormal lengths, mean about
# 30 tokens, a tail to 256 (make-corpus.py --mu 3.1 --max-words 254).
# Results: $OUT/scale-devices.md (the table), $OUT/scale-devices.json,
# $OUT/scale-devices.log and $OUT/details.tar.gz (every load's and daemon's
# own output).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/scale-devices}
mkdir -p "$OUT"
GPU=${SCALE_GPU:-1}
SECONDS_PER_LOAD=${SCALE_SECONDS:-10}
# Most important first: a time limit that stops the run leaves 1 and 8.
DEVICE_COUNTS=${SCALE_DEVICES:-1 8 2 4}
WORKERS=${SCALE_WORKERS:-1 2 4}
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin "${SCALE_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
BASE=""
if [ -n "${SCALE_BASE:-}" ]; then
  BASE=$SCALE_BASE
elif [ -f .carry/before/bin.tar.xz ]; then
  BASE=/tmp/replayd-before && mkdir -p "$BASE" && tar -C "$BASE" -xJf .carry/before/bin.tar.xz
fi
# The model: given, the f16 MiniLM gpu-carry.sh staged, or random f16
# weights on .carry/minilm-cfg (gpu-common.sh, carried_minilm_any).
MODEL=$(carried_minilm_any "${SCALE_MODEL:-}") || { echo "no f16 MiniLM under .carry"; exit 1; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export REPLAYD_LOG=${REPLAYD_LOG:-info}
WORK=$(mktemp -d)
DETAILS=$WORK/details
mkdir -p "$DETAILS"
T0=$(date +%s)
log() { echo "[scale +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/scale-devices.log"; }
FAILED=0
fail() { log "FAIL: $*"; FAILED=1; }
DAEMON=""
# The table of what ran (also when a time limit stops the run part way:
# the steps go most important first).
table() {
python3 - "$DETAILS" "$OUT" "$COMMIT" "$DEVICE_COUNTS" <<'PY' || true
import json, os, sys
details, out, commit = sys.argv[1], sys.argv[2], sys.argv[3]
counts = sorted(sys.argv[4].split(), key=int)
def texts(t):
    return "1 text" if t == "b1" else "32 texts"
def get(name):
    try:
        return json.load(open(f"{details}/load_{name}.json"))
    except OSError:
        return None
def cpu(name):
    try:
        groups = json.load(open(f"{details}/cpu_{name}.json"))["groups"]
    except (OSError, KeyError, ValueError):
        return ""
    parts = []
    for proc in ("daemon", "daemon/child", "loadgen"):
        mine = [g for g in groups if g["process"] == proc]
        if not mine:
            continue
        total = sum(g["cores"] for g in mine)
        top = sorted(mine, key=lambda g: -g["cores"])[:4]
        label = "workers" if proc == "daemon/child" else proc
        parts.append(f"{label} {total:.1f} (" + ", ".join(
            f"{g['threads']}×{g['thread_count']} {g['cores']:.2f}" for g in top) + ")")
    return "; ".join(parts)
rows, results = [], {}
def row(label, name, base=None):
    r = get(name)
    if r is None:
        rows.append(f"| {label} | missing | | | | | |")
        return
    results[name] = {k: r.get(k) for k in ("texts_per_s", "requests_per_s", "ok", "requests", "errors", "latency_us", "rate")}
    extra = ""
    if base is not None:
        extra = f"{r['texts_per_s'] / base:.2f}"
    errs = sum(r.get("errors", {}).values())
    rows.append(f"| {label} | {r['texts_per_s']:,.0f} | {extra} | {r['latency_us']['p50']:,} | {r['latency_us']['p99']:,} | "
                f"{r['ok']:,} ok, {errs} errors | {cpu(name)} |")
lines = [f"# Scaling with devices (issue 35), commit {commit}", "",
         "| load | texts/s | × (see section) | p50 µs | p99 µs | replies | CPU cores by thread group |",
         "|---|---|---|---|---|---|---|"]
sections = []
w1 = get("gpu_w1_b32")
for w in ("1", "2", "4"):
    if get(f"gpu_w{w}_b32"):
        row(f"real GPU, workers_per_gpu {w}, 32 texts/req (× workers_per_gpu 1)", f"gpu_w{w}_b32", w1 and w1["texts_per_s"])
if get("gpu_w4_fault"):
    row("real GPU, 4 workers, one killed (window around the fault)", "gpu_w4_fault", w1 and w1["texts_per_s"])
for b in ("cur", "base"):
    for t in ("b1", "b32"):
        if get(f"zero_{b}_{t}"):
            cur = get(f"zero_cur_{t}")
            row(f"zero-time, 8 devices, {texts(t)}/req, {'current' if b == 'cur' else 'baseline'} (× current)", f"zero_{b}_{t}",
                cur and cur["texts_per_s"])
for t in ("b1", "b32"):
    one = get(f"sim1_{t}")
    for n in counts:
        if get(f"sim{n}_{t}"):
            row(f"simulated GPU ×{n}, {texts(t)}/req (× one device; efficiency = ×/{n})", f"sim{n}_{t}", one and one["texts_per_s"])
    last = counts[-1]
    if get(f"sim{last}_base_{t}"):
        row(f"simulated GPU ×{last}, {texts(t)}/req, baseline (× one device, current)", f"sim{last}_base_{t}", one and one["texts_per_s"])
    if get(f"sim{last}_80_{t}"):
        r = get(f"sim{last}_80_{t}")
        row(f"simulated GPU ×{last}, {texts(t)}/req, open loop at {r.get('rate', 0):,.0f} req/s (80 %)", f"sim{last}_80_{t}")
try:
    fault = json.load(open(f"{details}/fault.json"))
    lines_fault = [f"", f"Killed worker back ({fault['state']}) {fault['back_s']} s after the kill."]
    results["fault"] = fault
except OSError:
    lines_fault = []
open(f"{out}/scale-devices.md", "w").write("\n".join(lines + rows + lines_fault) + "\n")
json.dump(results, open(f"{out}/scale-devices.json", "w"), indent=1)
print("\n".join(lines + rows + lines_fault))
PY
  tar -C "$WORK" -czf "$OUT/details.tar.gz" details
}
TABLED=0
cleanup() {
  [ -n "$DAEMON" ] && kill -TERM "$DAEMON" 2>/dev/null
  [ "$TABLED" = 1 ] || { log "stopped part way: the table holds what ran"; table; }
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

if [ -f .carry/COMMIT ]; then COMMIT=$(tr '\n' ' ' < .carry/COMMIT); else COMMIT=$(git rev-parse --short HEAD 2>/dev/null); fi
log "commit $COMMIT, baseline $(cat .carry/before/COMMIT 2>/dev/null || echo none), $(nproc) cores"
[ "$GPU" = 1 ] && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/scale-devices.log" 2>&1
python3 scripts/bench/make-corpus.py --mu 3.1 --max-words 254 --vocab "$MODEL/vocab.txt" "$WORK/corpus.jsonl" 2>&1 | tee -a "$OUT/scale-devices.log"

# start_daemon NAME BIN DEVICES-TOML [BATCHING-TOML]
start_daemon() {
  local name=$1 bin=$2 devices=$3 batching=${4:-}
  rm -f "$WORK/ready.json"
  cat > "$WORK/$name.toml" <<TOML
[server]
endpoint = "tcp://127.0.0.1:0"
control_endpoint = "ipc://$WORK/control.sock"
runtime_dir = "$WORK/run"

[batching]
$batching

[devices]
$devices

$(bert_model minilm "$MODEL" f16 packed)
TOML
  "$bin/replayd" --config "$WORK/$name.toml" --ready-file "$WORK/ready.json" > "$DETAILS/replayd_$name.log" 2>&1 &
  DAEMON=$!
  if ! wait_ready "$DAEMON" "$WORK/ready.json"; then
    fail "replayd ($name) did not become ready"; tail -20 "$DETAILS/replayd_$name.log"; DAEMON=""; return 1
  fi
  ENDPOINT=$(python3 -c "import json; print(json.load(open('$WORK/ready.json'))['endpoint'])")
  CTL=("$bin/replayctl" --control "ipc://$WORK/control.sock")
}
stop_daemon() {
  "${CTL[@]}" stats --json > "$DETAILS/stats_$1.json" 2>/dev/null
  kill -TERM "$DAEMON"; wait "$DAEMON"; DAEMON=""
}
# load NAME TEXTS-PER-REQUEST CONCURRENCY SOCKETS [loadgen args...]: one
# load on the running daemon, each thread group's CPU over its middle.
load() {
  local name=$1 batch=$2 conc=$3 sockets=$4; shift 4
  "$BIN/replayd-loadgen" --endpoint "$ENDPOINT" --model minilm --texts "$WORK/corpus.jsonl" --batch "$batch" \
    --concurrency "$conc" --sockets "$sockets" --engine threads --duration "$SECONDS_PER_LOAD" --warmup 2 \
    --json "$DETAILS/load_$name.json" "$@" > "$DETAILS/load_$name.log" 2>&1 &
  local lg=$!
  local window=$(( SECONDS_PER_LOAD - 4 )); [ "$window" -lt 1 ] && window=1
  sleep 3
  python3 scripts/bench/thread-cpu.py "$window" "$DETAILS/cpu_$name.json" daemon="$DAEMON" loadgen="$lg" \
    > /dev/null 2>&1 || log "thread-cpu $name failed"
  if wait "$lg"; then
    log "$name: $(grep -v '^{' "$DETAILS/load_$name.log" | head -1)"
  else
    fail "load $name"; tail -3 "$DETAILS/load_$name.log"
  fi
}

# --- 1. the time table
TIMINGS=$WORK/timings.json
if [ "$GPU" = 1 ]; then
  bert_model minilm "$MODEL" f16 packed > "$WORK/check.toml"
  log "backend-check: each packed bucket's time on this GPU"
  timeout 240 "$BIN/replayd" backend-check --config "$WORK/check.toml" --out "$TIMINGS" --iters 100 --warmup 10 \
    --no-eager --no-compare --check-rows 2 > "$DETAILS/backend_check.log" 2>&1 || fail "backend-check"
  cp "$TIMINGS" "$OUT/timings.json" 2>/dev/null
else
  # Without a GPU: 40 µs a batch plus 0.1 µs a token slot, per packed budget.
  python3 - "$TIMINGS" <<'PY'
import json, sys
budgets = [64 * k for k in range(1, 17)] + [1024 + 128 * k for k in range(1, 9)] + [2048 + 256 * k for k in range(1, 9)]
json.dump({"buckets": [{"model": "minilm", "bucket": f"{b}t", "us": 40 + 0.1 * b} for b in budgets]}, open(sys.argv[1], "w"))
PY
fi

# --- 2. zero-time devices: the host path's ceiling
for b in cur ${BASE:+base}; do
  bin=$BIN; [ "$b" = base ] && bin=$BASE
  start_daemon "zero_$b" "$bin" 'backend = "null"
cpu_devices = 8' || continue
  load "zero_${b}_b1" 1 2048 32
  load "zero_${b}_b32" 32 256 16
  stop_daemon "zero_$b"
done

# --- 3. simulated H200s
sim() { # NAME BIN DEVICES
  start_daemon "$1" "$2" "backend = \"null\"
cpu_devices = $3
null_timings = \"$TIMINGS\""
}
for n in $DEVICE_COUNTS; do
  sim "sim$n" "$BIN" "$n" || continue
  load "sim${n}_b1" 1 $(( 512 * n )) $(( n < 4 ? 8 * n : 32 ))
  load "sim${n}_b32" 32 $(( 32 * n )) $(( n < 2 ? 8 : 16 ))
  stop_daemon "sim$n"
done
last=$(echo $DEVICE_COUNTS | tr ' ' '\n' | sort -n | tail -1)
if [ -n "$BASE" ] && sim "sim${last}_base" "$BASE" "$last"; then
  load "sim${last}_base_b1" 1 $(( 512 * last )) 32
  load "sim${last}_base_b32" 32 $(( 32 * last )) 16
  stop_daemon "sim${last}_base"
fi

# --- 4. 80 % of the peak, open loop
if sim "sim${last}_80" "$BIN" "$last"; then
  for b in 1 32; do
    rate=$(python3 -c "import json; print(0.8 * json.load(open('$DETAILS/load_sim${last}_b$b.json'))['requests_per_s'])" 2>/dev/null)
    [ -n "$rate" ] && load "sim${last}_80_b$b" "$b" $(( b == 1 ? 4096 : 512 )) 32 --rate "$rate"
  done
  stop_daemon "sim${last}_80"
fi

# --- 5. several workers on the one GPU, and one killed under load
if [ "$GPU" = 1 ]; then
  for w in $WORKERS; do
    start_daemon "gpu_w$w" "$BIN" "backend = \"cuda\"
gpus = [0]
workers_per_gpu = $w" || continue
    load "gpu_w${w}_b32" 32 $(( 32 * w )) 8
    if [ "$w" = 4 ]; then
      # The fault: a 6 s load from 1 s before the kill covers it and the
      # restart; its every reply is counted.
      victim=$("${CTL[@]}" devices --json | python3 -c "import json,sys; d=json.load(sys.stdin); print([x for x in d['devices'] if x['label']=='cuda:0.1'][0]['worker_pid'])")
      SECONDS_PER_LOAD=6 load gpu_w4_fault 32 128 8 &
      lp=$!
      sleep 1
      kill -9 "$victim" && log "killed worker $victim (cuda:0.1) under load"
      killed_at=$(date +%s.%N)
      wait "$lp"
      for _ in $(seq 1 150); do
        state=$("${CTL[@]}" devices --json | python3 -c "import json,sys; d=json.load(sys.stdin); print([x for x in d['devices'] if x['label']=='cuda:0.1'][0]['state'])")
        [ "$state" = ready ] && break
        sleep 0.2
      done
      back=$(python3 -c "import time; print(f'{time.time() - $killed_at:.1f}')")
      log "cuda:0.1 $state again ${back} s after the kill"
      echo "{\"back_s\": $back, \"state\": \"$state\"}" > "$DETAILS/fault.json"
    fi
    stop_daemon "gpu_w$w"
  done
fi

table
TABLED=1
log "done"
exit "$FAILED"
