#!/usr/bin/env bash
# Runs the Python client's tests (clients/python/tests) against the real
# replayd binary. Creates .venv (git-ignored) when missing, installs the client
# and pytest into it (quietly; pip skips what is already there), fetches the
# model when missing, and runs pytest. Extra arguments go to pytest.
#
# The daemon binary: $REPLAYD_BIN, else target/debug/replayd (what cargo test
# builds), else target/release/replayd.
#
#   scripts/dev/python-tests.sh [pytest args]     # or: make python-test (make test runs it)
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$(pwd)
python=${PYTHON:-python3}
venv="$repo/.venv"

if [ ! -x "$venv/bin/python" ]; then
  echo "python-tests: creating $venv" >&2
  if ! "$python" -m venv "$venv"; then
    # e.g. Debian's python3 without python3-venv: use virtualenv from PyPI
    rm -rf "$venv"
    "$python" -m pip install --quiet --disable-pip-version-check --user virtualenv
    "$python" -m virtualenv --quiet "$venv"
  fi
fi
vpy="$venv/bin/python"
pipq=("$vpy" -m pip --disable-pip-version-check --quiet)

# Reinstall the client only when its sources changed (pip would otherwise
# rebuild the wheel every run).
stamp="$venv/.replayd-client.stamp"
sum=$(cd clients/python && { find pyproject.toml README.md replayd -type f \( -name '*.py' -o -name '*.toml' -o -name '*.md' -o -name py.typed \) 2>/dev/null || true; } | LC_ALL=C sort | xargs cat | cksum)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sum" ] || ! "$vpy" -c 'import replayd, pytest' 2>/dev/null; then
  echo "python-tests: installing clients/python and pytest into .venv" >&2
  "${pipq[@]}" install "$repo/clients/python" "pytest>=7"
  echo "$sum" >"$stamp"
fi

PYTHON="$vpy" scripts/dev/fetch-model.sh

if [ -z "${REPLAYD_BIN:-}" ]; then
  for b in target/debug/replayd target/release/replayd; do
    if [ -x "$b" ]; then REPLAYD_BIN="$repo/$b"; break; fi
  done
fi
if [ -z "${REPLAYD_BIN:-}" ] || [ ! -x "$REPLAYD_BIN" ]; then
  echo "python-tests: no replayd binary (build it with cargo build, or set REPLAYD_BIN)" >&2
  exit 2
fi
export REPLAYD_BIN
echo "python-tests: testing against $REPLAYD_BIN" >&2

# The pytest script (not `python -m pytest`, which puts the current folder on
# sys.path) so that the tests import the installed package, not the sources.
exec "$venv/bin/pytest" -q -p no:cacheprovider clients/python/tests "$@"
