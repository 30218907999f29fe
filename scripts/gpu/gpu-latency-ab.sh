#!/usr/bin/env bash
# Issue 10's target 1 (one 12–16-token text at a time from one client over
# tcp loopback) on a GPU machine, once per variant, in one call: for an A/B
# of settings that move a lone request's latency, without the rest of
# scripts/bench/bench-host.sh (sentence-transformers, the loads of target 3).
#
#   OUT=$OUT VARIANTS='default;no worker spin||worker_spin_us = 0|;no staging||kernel_paths_off = ["staged_io"]|' \
#     scripts/gpu/gpu-latency-ab.sh
#
# A variant is "name|[server] lines|[devices] lines|environment|replayd-loadgen
# arguments" (e.g. "--engine threads"; the last fields may be left out; lines
# separated by "\n" escapes, e.g. "io_threads = 1\nclient_sockets = 1");
# variants are separated by ";". Each runs twice, interleaved (A B A B), so
# drift between runs shows. Binaries and the f16 model come from
# scripts/gpu/gpu-carry.sh (carry .carry). Writes $OUT/latency-ab.md and the
# daemons' logs as $OUT/latency-ab-logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/latency-ab}
mkdir -p "$OUT"
SECONDS_EACH=${SECONDS_EACH:-6}
ROUNDS=${ROUNDS:-2}
BACKEND=${AB_BACKEND:-cuda}
. scripts/gpu/gpu-common.sh
# Binaries and the f16 MiniLM: given, or as scripts/gpu/gpu-carry.sh staged them.
BIN=$(carried_bin "${AB_BIN:-}") || { echo "no binaries (run scripts/gpu/gpu-carry.sh, carry .carry)"; exit 1; }
MODEL=$(carried_minilm_f16 "${AB_MODEL:-}") || { echo "no f16 MiniLM under .carry"; exit 1; }
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
WORK=$(mktemp -d)
DAEMON=""
cleanup() { [ -n "$DAEMON" ] && kill -TERM "$DAEMON" 2>/dev/null; rm -rf "$WORK"; }
mkdir -p "$WORK/logs"
trap cleanup EXIT
python3 scripts/bench/make-short-texts.py "$MODEL/vocab.txt" "$WORK/short.jsonl"
case "$BACKEND" in
  cuda) DEVICES='backend = "cuda"
gpus = [0]' ;;
  *) DEVICES="backend = \"$BACKEND\"
cpu_devices = 1" ;;
esac
MD=$OUT/latency-ab.md
{
  echo "# target 1 A/B, $(date -u +%FT%TZ), commit $(cat .carry/COMMIT 2>/dev/null | tr '\n' ' '), backend $BACKEND, $(nproc) cores"
  echo ""
  echo "| variant | round | p50 µs | p99 µs | daemon hops p50 µs |"
  echo "|---|---|---|---|---|"
} > "$MD"
IFS=';' read -r -a VARS <<< "${VARIANTS:-default}"
for round in $(seq 1 "$ROUNDS"); do
  for v in "${VARS[@]}"; do
    IFS='|' read -r name server devices envs lgargs <<< "$v"
    tag=$(echo "$name" | tr -c 'A-Za-z0-9_-' _)
    rm -f "$WORK/ready.json"
    cat > "$WORK/c.toml" <<TOML
[server]
endpoint = "tcp://127.0.0.1:0"
control_endpoint = "ipc://$WORK/control.sock"
runtime_dir = "$WORK/run"
$(printf '%b' "${server:-}")

[devices]
$DEVICES
$(printf '%b' "${devices:-}")

$(bert_model minilm "$MODEL" f16 packed)
TOML
    # shellcheck disable=SC2086
    env ${envs:-} "$BIN/replayd" --config "$WORK/c.toml" --ready-file "$WORK/ready.json" > "$WORK/logs/replayd_$tag.log" 2>&1 &
    DAEMON=$!
    if ! wait_ready "$DAEMON" "$WORK/ready.json"; then
      echo "| $name | $round | daemon not ready | | $(tail -1 "$WORK/logs/replayd_$tag.log") |" >> "$MD"; DAEMON=""; continue
    fi
    EP=$(python3 -c "import json; print(json.load(open('$WORK/ready.json'))['endpoint'])")
    # shellcheck disable=SC2086
    "$BIN/replayd-loadgen" --endpoint "$EP" --model minilm --texts "$WORK/short.jsonl" --batch 1 --concurrency 1 \
      --sockets 1 --duration "$SECONDS_EACH" --warmup 1 ${lgargs:-} > "$WORK/load.log" 2>&1
    kill -TERM "$DAEMON"; wait "$DAEMON"; DAEMON=""
    python3 - "$WORK/load.log" "$name" "$round" >> "$MD" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"latency p50 (\d+) µs, p99 (\d+) µs", text)
h = re.search(r"hops p50 µs: (.*)", text)
errs = re.search(r"(\d+) errors", text)
if not m:
    print(f"| {sys.argv[2]} | {sys.argv[3]} | no result | | {text.strip().splitlines()[-1] if text.strip() else ''} |")
else:
    bad = f" ({errs.group(1)} errors)" if errs and errs.group(1) != "0" else ""
    print(f"| {sys.argv[2]} | {sys.argv[3]} | {m.group(1)} | {m.group(2)} | {h.group(1) if h else ''}{bad} |")
PY
  done
done
# The daemons' logs in one file (the device tool brings back few files).
tar -C "$WORK" -czf "$OUT/latency-ab-logs.tar.gz" logs
cat "$MD"
