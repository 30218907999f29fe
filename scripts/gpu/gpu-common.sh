# Shared by the scripts that run on a GPU machine (bench-host.sh,
# gpu-check.sh, gpu-kernel-ab.sh, gpu-latency-ab.sh, gpu-families.sh,
# gpu-family-speed.sh).
# Sourced from the repository root (`. scripts/gpu/gpu-common.sh`); defines
# functions and nothing else.

# carried_bin [DIR]: prints DIR when given, else unpacks the binaries that
# scripts/gpu/gpu-carry.sh staged under .carry/ into /tmp/replayd-bin and prints
# that (the GPU machine has no cargo).
carried_bin() {
  if [ -n "${1:-}" ]; then echo "$1"; return; fi
  mkdir -p /tmp/replayd-bin && tar -C /tmp/replayd-bin -xJf .carry/bin.tar.xz && echo /tmp/replayd-bin
}

# carried_minilm_f16 [DIR]: prints DIR when given, else the f16
# all-MiniLM-L6-v2 that scripts/gpu/gpu-carry.sh staged, unpacked once into
# /tmp/minilm-f16 (the fp32 weights are over the carry limit).
carried_minilm_f16() {
  if [ -n "${1:-}" ]; then echo "$1"; return; fi
  local dir=/tmp/minilm-f16
  if [ ! -f "$dir/model.safetensors" ]; then
    rm -rf "$dir" && cp -R .carry/minilm-f16 "$dir" && xz -d "$dir/model.safetensors.xz" || return 1
  fi
  echo "$dir"
}

# bert_model NAME PATH DTYPE BATCHING [LINE...]: one [[models]] stanza of a
# BERT-family folder, the LINEs (e.g. 'seq_buckets = [16]') after its keys.
bert_model() {
  local name=$1 path=$2 dtype=$3 batching=$4
  shift 4
  printf '[[models]]\nname = "%s"\nkind = "bert"\npath = "%s"\ndtype = "%s"\nbatching = "%s"\n' \
    "$name" "$path" "$dtype" "$batching"
  local line
  for line in "$@"; do echo "$line"; done
}

# wait_ready PID FILE [TRIES]: waits (0.2 s a try, 900 tries by default) for
# a daemon started with --ready-file FILE; fails if PID exits first or the
# file never comes.
wait_ready() {
  local pid=$1 file=$2 tries=${3:-900}
  for _ in $(seq 1 "$tries"); do
    [ -f "$file" ] && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.2
  done
  [ -f "$file" ]
}

# carried_minilm_any [DIR]: prints DIR when given; else the f16 MiniLM that
# gpu-carry.sh staged; else, where the carry limit left no room for its
# weights, .carry/minilm-cfg (config and tokenizer) with random f16 weights
# made here once, in /tmp/minilm-random (for host-path runs: a batch's time
# does not depend on the weights' values).
carried_minilm_any() {
  if [ -z "${1:-}" ] && [ ! -f .carry/minilm-f16/model.safetensors.xz ] && [ -d .carry/minilm-cfg ]; then
    local dir=/tmp/minilm-random
    if [ ! -f "$dir/model.safetensors" ]; then
      rm -rf "$dir" && cp -R .carry/minilm-cfg "$dir" || return 1
      python3 - "$dir" <<'PY' >&2 || { echo "cannot make random MiniLM weights" >&2; return 1; }
import sys, torch
from safetensors.torch import save_file
from transformers import BertConfig, BertModel
torch.manual_seed(0)
model = BertModel(BertConfig.from_pretrained(sys.argv[1])).half()
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{sys.argv[1]}/model.safetensors")
PY
    fi
    echo "$dir"
    return 0
  fi
  carried_minilm_f16 "${1:-}"
}
