#!/usr/bin/env bash
# The host path's settings against each other (issue 35), in one run on the
# GPU machine's 16 cores: which runtime thread count, spin settings, socket
# shards and batcher shards let the daemon answer the most one-text requests
# on 8 zero-time devices (null backend, no time per batch), where the host
# path alone sets the limit. Builds nothing: the binaries that
# scripts/gpu/gpu-carry.sh stages under .carry/ (replayd, replayctl,
# replayd-loadgen) and the f16 MiniLM (its tokenizer; the null backend runs
# none of its weights).
#
#   OUT=dir scripts/bench/host-tuning.sh            # there, about 3 minutes
#   HT_SECONDS=4 HT_VARIANTS="default spin0" scripts/bench/host-tuning.sh
#
# Each variant: a daemon with that variant's TOML lines, one closed-loop
# load of 1 text per request (2,048 in flight over 32 sockets) and one of 32
# texts per request (256 in flight over 16 sockets), the corpus of
# make-corpus.py (lognormal, mean about 30 tokens, a tail to 256), each
# thread group's CPU over the load (scripts/bench/thread-cpu.py). Every
# reply is counted by the load generator; errors are in the table.
# Results: $OUT/host-tuning.md and the loads' JSON in $OUT/details.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host-tuning}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
. scripts/gpu/gpu-common.sh
BIN=$(carried_bin "${HT_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
# The model: given, the f16 MiniLM gpu-carry.sh staged, or random f16
# weights on .carry/minilm-cfg (gpu-common.sh, carried_minilm_any).
MODEL=$(carried_minilm_any "${HT_MODEL:-}") || { echo "no f16 MiniLM under .carry"; exit 1; }
SECONDS_PER_LOAD=${HT_SECONDS:-6}
DEVICES=${HT_DEVICES:-8}
WORK=$(mktemp -d)
DETAILS=$WORK/details
mkdir -p "$DETAILS"
T0=$(date +%s)
log() { echo "[host-tuning +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/host-tuning.log"; }
DAEMON=""
trap '[ -n "$DAEMON" ] && kill -TERM "$DAEMON" 2>/dev/null; rm -rf "$WORK"' EXIT
trap 'exit 143' TERM INT

# The variants: NAME, then TOML lines for [server], [devices] and
# [batching], each part separated by '|' and lines within a part by ';'.
declare -A VARIANT=(
  [default]="||"
  [spin0]="io_spin_us = 0|worker_spin_us = 0|"
  [rt8]="runtime_threads = 8||"
  [rt8_spin0]="runtime_threads = 8;io_spin_us = 0|worker_spin_us = 0|"
  [rt12_spin0]="runtime_threads = 12;io_spin_us = 0|worker_spin_us = 0|"
  [sockets8_spin0]="client_sockets = 8;io_spin_us = 0|worker_spin_us = 0|"
  [sockets2_spin0]="client_sockets = 2;io_spin_us = 0|worker_spin_us = 0|"
  [shards8_spin0]="io_spin_us = 0|worker_spin_us = 0|shards = 8"
  [tok2_spin0]="tokenizer_threads = 2;io_spin_us = 0|worker_spin_us = 0|"
  [inline2k]="inline_tokenize_bytes = 2048||"
  [inline2k_spin0]="inline_tokenize_bytes = 2048;io_spin_us = 0|worker_spin_us = 0|"
)
ORDER=${HT_VARIANTS:-default spin0 inline2k inline2k_spin0 rt8_spin0 rt12_spin0 sockets8_spin0 sockets2_spin0 shards8_spin0 tok2_spin0 rt8}

log "commit $(tr '\n' ' ' < .carry/COMMIT 2>/dev/null), $(nproc) cores, $DEVICES zero-time devices"
python3 scripts/bench/make-corpus.py --mu 3.1 --max-words 254 --vocab "$MODEL/vocab.txt" "$WORK/corpus.jsonl" 2>&1 | tee -a "$OUT/host-tuning.log"

part() { echo "$1" | cut -d'|' -f"$2" | tr ';' '\n'; }

for name in $ORDER; do
  spec=${VARIANT[$name]:-}
  [ -n "$spec" ] || { log "no variant $name"; continue; }
  cat > "$WORK/$name.toml" <<TOML
[server]
endpoint = "tcp://127.0.0.1:0"
control_endpoint = "ipc://$WORK/control.sock"
runtime_dir = "$WORK/run"
$(part "$spec" 1)

[batching]
$(part "$spec" 3)

[devices]
backend = "null"
cpu_devices = $DEVICES
$(part "$spec" 2)

$(bert_model minilm "$MODEL" f16 packed)
TOML
  rm -f "$WORK/ready.json"
  "$BIN/replayd" --config "$WORK/$name.toml" --ready-file "$WORK/ready.json" > "$DETAILS/replayd_$name.log" 2>&1 &
  DAEMON=$!
  if ! wait_ready "$DAEMON" "$WORK/ready.json" 150; then
    log "FAIL: replayd ($name) did not become ready"; tail -5 "$DETAILS/replayd_$name.log"; DAEMON=""; continue
  fi
  endpoint=$(python3 -c "import json; print(json.load(open('$WORK/ready.json'))['endpoint'])")
  for load in "b1 1 2048 32" "b32 32 256 16"; do
    set -- $load
    "$BIN/replayd-loadgen" --endpoint "$endpoint" --model minilm --texts "$WORK/corpus.jsonl" --batch "$2" \
      --concurrency "$3" --sockets "$4" --engine threads --duration "$SECONDS_PER_LOAD" --warmup 2 \
      --json "$DETAILS/load_${name}_$1.json" > "$DETAILS/load_${name}_$1.log" 2>&1 &
    lg=$!
    sleep 2.5
    python3 scripts/bench/thread-cpu.py $(( SECONDS_PER_LOAD - 3 )) "$DETAILS/cpu_${name}_$1.json" \
      daemon="$DAEMON" loadgen="$lg" > /dev/null 2>&1
    wait "$lg" || log "FAIL: load ${name}_$1"
    log "$name $1: $(grep -v '^{' "$DETAILS/load_${name}_$1.log" | head -1)"
  done
  kill -TERM "$DAEMON"; wait "$DAEMON"; DAEMON=""
done

python3 - "$DETAILS" "$OUT" "$ORDER" <<'PY'
import json, sys
details, out, order = sys.argv[1], sys.argv[2], sys.argv[3].split()
def get(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None
def cpu(name):
    c = get(f"{details}/cpu_{name}.json")
    if not c:
        return ""
    by = {}
    for g in c.get("groups", []):
        key = {"daemon/child": "workers"}.get(g["process"], g["process"])
        if g["process"] == "daemon":
            t = g["threads"]
            key = ("runtime" if t == "replayd" else "tokenize" if t.startswith("tokenize")
                   else "zmq" if t.startswith("ZMQbg/IO") else "daemon other")
        by[key] = by.get(key, 0) + g["cores"]
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(by.items()))
lines = ["| variant | load | texts/s | p50 µs | p99 µs | replies | CPU cores |", "|---|---|---|---|---|---|---|"]
for name in order:
    for t, label in (("b1", "1 text/req"), ("b32", "32 texts/req")):
        r = get(f"{details}/load_{name}_{t}.json")
        if r is None:
            lines.append(f"| {name} | {label} | missing | | | | |")
            continue
        errs = sum(r.get("errors", {}).values())
        lines.append(f"| {name} | {label} | {r['texts_per_s']:,.0f} | {r['latency_us']['p50']:,} | {r['latency_us']['p99']:,} | "
                     f"{r['ok']:,} ok, {errs} errors | {cpu(f'{name}_{t}')} |")
open(f"{out}/host-tuning.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
tar -C "$WORK" -czf "$OUT/details.tar.gz" details
