#!/bin/sh
# Installs NVRTC (the CUDA run-time compiler, ~90 MB) from PyPI into <repo>/.nvrtc
# so that `cargo test` can compile every kernel in kernels/ for sm_90 on a machine
# with no GPU and no CUDA toolkit (tests/kernels_compile.rs looks there).
#
# The version is pinned to the CUDA release of the GPU machines' driver
# (580 = CUDA 13.0): an NVRTC newer than the driver produces PTX it rejects.
#
# Usage: scripts/dev/install-nvrtc.sh            (idempotent; quick when already there)
set -eu
VERSION="${REPLAYD_NVRTC_VERSION:-13.0.88}"
repo="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$repo/.nvrtc"
lib="$dest/nvidia/cu13/lib"
if [ -f "$lib/libnvrtc.so.13" ] && [ -f "$dest/.version" ] && [ "$(cat "$dest/.version")" = "$VERSION" ]; then
    echo "NVRTC $VERSION already in $lib"
    exit 0
fi
rm -rf "$dest"
python3 -m pip install --disable-pip-version-check --no-deps --quiet --target "$dest" "nvidia-cuda-nvrtc==$VERSION"
test -f "$lib/libnvrtc.so.13" || { echo "error: $lib/libnvrtc.so.13 missing after install" >&2; exit 1; }
echo "$VERSION" > "$dest/.version"
echo "NVRTC $VERSION installed in $lib"
