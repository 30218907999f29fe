#!/usr/bin/env bash
# Checks the deployment files, as CI would on a fresh Debian 12 machine (systemd
# need not be running: nothing here talks to a service manager).
#
#   1. scripts/dev/install.sh into throw-away roots (PREFIX=/usr and /usr/local), with
#      the built binaries or stand-ins;
#   2. systemd-analyze verify on the installed unit: any warning fails;
#   3. systemd-sysusers and systemd-tmpfiles on those roots (as root);
#   4. systemd-analyze security --offline: fails above MAX_EXPOSURE (3.5), prints
#      the score and the remaining exposures;
#   5. every YAML file under deploy/kubernetes/ against the Kubernetes API schema
#      (kubernetes-validate from PyPI, strict: unknown fields fail);
#   6. the installed config and the ConfigMap's config parse as replayd configs
#      (when a replayctl binary is at hand).
#
# Installs what it lacks: Debian's systemd package (systemd-analyze), python3 with
# venv, and kubernetes-validate into a cached venv (offline after the first run).
# Variables: MAX_EXPOSURE (3.5), K8S_VERSION (the schema version; default: the
# validator's newest), CHECK_DEPLOY_CACHE (where the venv lives).
#
#   scripts/dev/check-deploy.sh     # or: make check-deploy (make test runs it)
set -uo pipefail
cd "$(dirname "$0")/../.."

MAX_EXPOSURE=${MAX_EXPOSURE:-3.5}
KUBERNETES_VALIDATE_VERSION=1.37.0
CACHE=${CHECK_DEPLOY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/replayd-check-deploy}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
FAILED=0
step() { echo; echo "== $*"; }
fail() { echo "FAIL: $*"; FAILED=1; }
pass() { echo "ok: $*"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo > /dev/null; then sudo "$@"
  else echo "need root for: $*" >&2; return 1
  fi
}
apt_install() {
  echo "installing Debian packages: $*"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" > "$WORK/apt.log" 2>&1 \
    || { as_root apt-get update > "$WORK/apt.log" 2>&1 \
         && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >> "$WORK/apt.log" 2>&1; } \
    || { tail -20 "$WORK/apt.log"; return 1; }
}

# --- 0. tools -----------------------------------------------------------------
step "tools"
if ! command -v systemd-analyze > /dev/null; then
  apt_install systemd || { echo "FAIL: cannot install systemd"; exit 1; }
fi
echo "$(systemd-analyze --version | head -1)"
if ! python3 -c 'import venv, ensurepip' 2> /dev/null; then
  apt_install python3 python3-venv || { echo "FAIL: cannot install python3-venv"; exit 1; }
fi
VENV=$CACHE/venv
if ! "$VENV/bin/kubernetes-validate" --version 2> /dev/null | grep -q "$KUBERNETES_VALIDATE_VERSION"; then
  echo "installing kubernetes-validate $KUBERNETES_VALIDATE_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV" \
    && "$VENV/bin/pip" install --quiet --disable-pip-version-check \
         "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" \
    || { echo "FAIL: cannot install kubernetes-validate"; exit 1; }
fi
echo "kubernetes-validate $("$VENV/bin/kubernetes-validate" --version 2>&1 | tail -1)"

# Binaries to install: the built ones, else executable stand-ins (verify only
# checks that ExecStart= and ExecReload= name executables).
BIN_SRC=target/release
REPLAYCTL=
if [ -x target/release/replayd ] && [ -x target/release/replayctl ]; then
  REPLAYCTL=$PWD/target/release/replayctl
else
  BIN_SRC=$WORK/stand-in
  mkdir -p "$BIN_SRC"
  for b in replayd replayctl; do printf '#!/bin/sh\nexit 0\n' > "$BIN_SRC/$b"; chmod +x "$BIN_SRC/$b"; done
  REPLAYCTL=$(command -v replayctl || true)
fi

# --- 1. install into throw-away roots ------------------------------------------
step "install.sh into temporary roots"
for prefix in /usr /usr/local; do
  root=$WORK/root$(echo $prefix | tr / -)
  mkdir -p "$root"
  # verify needs the units the service refers to (multi-user.target, ...): the
  # host's own systemd units, which the systemd package installs.
  mkdir -p "$root/usr/lib/systemd"
  cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
  if BIN_SRC=$BIN_SRC PREFIX=$prefix DESTDIR=$root scripts/dev/install.sh > "$WORK/install$(echo $prefix | tr / _).log" 2>&1; then
    pass "PREFIX=$prefix"
  else
    fail "install.sh PREFIX=$prefix"; cat "$WORK/install$(echo $prefix | tr / _).log"
  fi
done
# A second run keeps the operator's config.
root=$WORK/root-usr
echo "# operator's edit" >> "$root/etc/replayd/replayd.toml"
BIN_SRC=$BIN_SRC PREFIX=/usr DESTDIR=$root scripts/dev/install.sh > /dev/null 2>&1
if tail -1 "$root/etc/replayd/replayd.toml" | grep -q "operator's edit" && [ -f "$root/etc/replayd/replayd.toml.new" ]; then
  pass "an existing config is kept (the new default goes to replayd.toml.new)"
else
  fail "install.sh overwrote an existing config"
fi

# --- 2. systemd-analyze verify --------------------------------------------------
step "systemd-analyze verify"
for prefix in /usr /usr/local; do
  root=$WORK/root$(echo $prefix | tr / -)
  unit=$root$prefix/lib/systemd/system/replayd.service
  # verify exits 0 on unknown keys and unparsable values; treat any output as failure.
  if out=$(systemd-analyze verify --root="$root" "$unit" 2>&1) && [ -z "$out" ]; then
    pass "replayd.service (PREFIX=$prefix: $(grep -m1 '^ExecStart=' "$unit"))"
  else
    fail "systemd-analyze verify (PREFIX=$prefix)"; echo "$out"
  fi
done

# --- 3. sysusers and tmpfiles ---------------------------------------------------
step "systemd-sysusers and systemd-tmpfiles"
root=$WORK/root-usr
if [ "$(id -u)" = 0 ]; then
  mkdir -p "$root/etc"
  if systemd-sysusers --root="$root" > "$WORK/sysusers.log" 2>&1 \
      && grep -q '^replayd:' "$root/etc/passwd" && grep -q '^replayd:' "$root/etc/group"; then
    pass "sysusers: $(grep '^replayd:' "$root/etc/passwd")"
  else
    fail "systemd-sysusers"; cat "$WORK/sysusers.log"
  fi
  if systemd-tmpfiles --root="$root" --create "$root/usr/lib/tmpfiles.d/replayd.conf" > "$WORK/tmpfiles.log" 2>&1 \
      && [ -z "$(cat "$WORK/tmpfiles.log")" ]; then
    uid=$(awk -F: '$1 == "replayd" {print $3}' "$root/etc/passwd")
    bad=
    for d in var/lib/replayd/models var/cache/replayd/kernels; do
      [ "$(stat -c '%u %a' "$root/$d" 2> /dev/null)" = "$uid 750" ] || bad="$bad $d"
    done
    if [ -z "$bad" ]; then pass "tmpfiles: /var/lib/replayd/models, /var/cache/replayd/kernels owned by replayd, 0750"
    else fail "tmpfiles: wrong owner or mode:$bad"; fi
  else
    fail "systemd-tmpfiles"; cat "$WORK/tmpfiles.log"
  fi
else
  echo "skipped: not root (chown in a foreign root needs it)"
fi

# --- 4. systemd-analyze security -------------------------------------------------
step "systemd-analyze security (offline, at most $MAX_EXPOSURE)"
root=$WORK/root-usr
unit=$root/usr/lib/systemd/system/replayd.service
threshold=$(awk -v m="$MAX_EXPOSURE" 'BEGIN { printf "%d", m * 10 + 0.5 }')
systemd-analyze security --offline=yes --root="$root" --threshold="$threshold" --no-pager "$unit" > "$WORK/security.txt" 2>&1
security_rc=$?
score=$(sed -nE 's/.*Overall exposure level for [^:]*: ([0-9.]+).*/\1/p' "$WORK/security.txt" | tail -1)
if [ -z "$score" ]; then
  fail "no exposure score"; cat "$WORK/security.txt"
else
  echo "remaining exposures (highest first):"
  grep '✗' "$WORK/security.txt" | awk '{ e = $NF; $1 = ""; $NF = ""; printf "  %4s %s\n", e, $0 }' | sort -rn | head -12
  echo "EXPOSURE SCORE: $score (limit $MAX_EXPOSURE)  $(grep -oE '[0-9.]+ [A-Z]+ ' "$WORK/security.txt" | tail -1)"
  if [ $security_rc -ne 0 ] || ! awk -v s="$score" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(s <= m) }'; then
    fail "exposure $score is above $MAX_EXPOSURE"
  else
    pass "exposure $score <= $MAX_EXPOSURE"
  fi
fi

# --- 5. Kubernetes manifests -----------------------------------------------------
step "Kubernetes manifests (kubernetes-validate --strict${K8S_VERSION:+, Kubernetes $K8S_VERSION})"
mapfile -t manifests < <(find deploy/kubernetes -type f \( -name '*.yaml' -o -name '*.yml' \) | sort)
if [ ${#manifests[@]} -eq 0 ]; then
  fail "no YAML under deploy/kubernetes/"
fi
for f in "${manifests[@]}"; do
  if out=$("$VENV/bin/kubernetes-validate" --strict ${K8S_VERSION:+-k "$K8S_VERSION"} "$f" 2>&1) \
      && ! echo "$out" | grep -qiE 'error|warn|fail'; then
    pass "$out"
  else
    fail "$f"; echo "$out"
  fi
done

# --- 6. the configs parse -------------------------------------------------------
step "replayd configs"
if [ -n "$REPLAYCTL" ]; then
  "$VENV/bin/python" - "$WORK/configmap.toml" deploy/kubernetes/configmap.yaml <<'PY'
import sys, yaml
out, path = sys.argv[1], sys.argv[2]
for doc in yaml.safe_load_all(open(path)):
    if doc and doc.get("kind") == "ConfigMap":
        open(out, "w").write(doc["data"]["replayd.toml"])
PY
  for cfg in "$WORK/root-usr/etc/replayd/replayd.toml" "$WORK/configmap.toml"; do
    # replayctl loads and validates the whole config before it connects: a
    # connection failure means the config was good.
    out=$("$REPLAYCTL" --config "$cfg" --timeout 1 health 2>&1)
    if echo "$out" | grep -qE 'cannot connect|no answer'; then
      pass "$(basename "$cfg") parses ($(echo "$out" | grep -oE 'ipc://[^:]*'))"
    else
      fail "$(basename "$cfg"): $out"
    fi
  done
else
  echo "skipped: no replayctl (build it, or put one in PATH)"
fi

echo
if [ $FAILED -ne 0 ]; then
  echo "check-deploy: FAILED"
  exit 1
fi
echo "check-deploy: all checks passed (exposure $score)"
