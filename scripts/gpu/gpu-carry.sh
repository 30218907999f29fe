#!/usr/bin/env bash
# Stages what the GPU-side scripts (scripts/gpu/*.sh, scripts/bench/bench-host.sh)
# need on a GPU machine that has no cargo and no network: stripped release
# binaries in .carry/bin, the commit they were built from, and an f16 copy of
# all-MiniLM-L6-v2 in .carry/minilm-f16 (xz-compressed; the f32 weights are too
# large to carry; the check computes its reference embeddings there with
# sentence-transformers on these same weights).
# .carry/ is git-ignored; pass it to the device tool's `carry`.
# With CARRY_BEFORE=REV it first builds that revision's binaries too, into
# .carry/before/ (for scripts/gpu/before-after.sh), in a scratch worktree and
# the same target directory (the current tree's are built after it).
#
#   scripts/gpu/gpu-carry.sh                      # here, after any change; then carry .carry
#   CARRY_EMBEDDED=90 CARRY_BINS="replayd replayctl" scripts/gpu/gpu-carry.sh
#                                                 # also a build with the sm_90 kernels
#                                                 # inside, for scripts/gpu/cold-start.sh
#   CARRY_BEFORE=2dead66 CARRY_BINS="replayd replayctl" scripts/gpu/gpu-carry.sh
#                                                 # also the build of 2dead66 (and only
#                                                 # what before-after.sh runs, to fit)
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -n "${CARRY_BEFORE:-}" ]; then
  repo=$(pwd)
  wt=$(mktemp -d)/before
  git worktree add --detach "$wt" "$CARRY_BEFORE"
  ln -s "$repo/models" "$wt/models"
  (cd "$wt" && CARGO_TARGET_DIR="$repo/target" cargo build --release --bins)
  rm -rf .carry/before && mkdir -p .carry/before/stage
  for b in replayd replayctl; do strip -o ".carry/before/stage/$b" "target/release/$b"; done
  tar -C .carry/before/stage -cJf .carry/before/bin.tar.xz replayd replayctl
  rm -rf .carry/before/stage
  git -C "$wt" rev-parse --short HEAD > .carry/before/COMMIT
  git worktree remove --force "$wt"
fi
if [ -n "${CARRY_EMBEDDED:-}" ]; then
  # The same tree built with its kernels inside (build.rs), for
  # scripts/gpu/cold-start.sh; the build below carries none unless
  # REPLAYD_EMBED_KERNELS is set.
  REPLAYD_EMBED_KERNELS="$CARRY_EMBEDDED" cargo build --release --bins
  rm -rf .carry/embedded && mkdir -p .carry/embedded/stage
  for b in replayd replayctl; do strip -o ".carry/embedded/stage/$b" "target/release/$b"; done
  tar -C .carry/embedded/stage -cJf .carry/embedded/bin.tar.xz replayd replayctl
  rm -rf .carry/embedded/stage
fi
REPLAYD_EMBED_KERNELS="${REPLAYD_EMBED_KERNELS:-}" cargo build --release --bins --example cuda_selftest --example family_check
# Compressed: the carry limit is 64 MiB (the tree included) and the model
# takes 40. CARRY_BINS names fewer binaries where the rest does not fit (the
# before/after run needs only replayd and replayctl).
BINS=${CARRY_BINS:-replayd replayctl replayd-loadgen replayd-hostbench cuda_selftest family_check}
rm -rf .carry/bin .carry/bin.tar.gz .carry/bin.tar.xz
mkdir -p .carry/stage
for b in $BINS; do
  if [ -f "target/release/$b" ]; then src="target/release/$b"; else src="target/release/examples/$b"; fi
  strip -o ".carry/stage/$b" "$src"
done
# shellcheck disable=SC2086
tar -C .carry/stage -cJf .carry/bin.tar.xz $BINS
rm -rf .carry/stage
git rev-parse --short HEAD > .carry/COMMIT
git diff --quiet HEAD || echo "+uncommitted" >> .carry/COMMIT
if [ ! -f .carry/minilm-f16/model.safetensors.xz ]; then
  scripts/dev/fetch-model.sh
  python3 - <<'PY'
import json, os, shutil, struct
src, dst = "models/all-MiniLM-L6-v2", ".carry/minilm-f16"
os.makedirs(dst, exist_ok=True)
for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "vocab.txt", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"]:
    shutil.copy(os.path.join(src, f), dst)
shutil.copytree(os.path.join(src, "1_Pooling"), os.path.join(dst, "1_Pooling"), dirs_exist_ok=True)
# Rewrite model.safetensors with f32 tensors as f16 (no numpy needed).
raw = open(os.path.join(src, "model.safetensors"), "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
data = raw[8 + n:]
out_header, chunks, offset = {}, [], 0
for name, info in sorted((k, v) for k, v in header.items() if k != "__metadata__"):
    a, b = info["data_offsets"]
    blob = data[a:b]
    if info["dtype"] == "F32":
        vals = struct.unpack(f"<{len(blob) // 4}f", blob)
        blob = struct.pack(f"<{len(vals)}e", *vals)
        info = dict(info, dtype="F16")
    out_header[name] = dict(info, data_offsets=[offset, offset + len(blob)])
    chunks.append(blob)
    offset += len(blob)
out_header["__metadata__"] = {"format": "pt"}
h = json.dumps(out_header).encode()
h += b" " * (-len(h) % 8)
with open(os.path.join(dst, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for c in chunks:
        f.write(c)
PY
  # The tree, the binaries and the model must fit the 64 MiB carry limit:
  # f16 weights compress by about a tenth.
  xz -9 -T2 .carry/minilm-f16/model.safetensors
fi
du -sh .carry
