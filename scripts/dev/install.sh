#!/usr/bin/env bash
# Installs replayd as a systemd service:
#
#   $PREFIX/bin/{replayd,replayctl}                 from target/release/ (make build)
#   /etc/replayd/replayd.toml                       from config/replayd.toml, adjusted for
#                                                   the service; an existing one is kept
#   $UNITDIR/replayd.service                        from systemd/, binary paths for $PREFIX
#   $SYSUSERSDIR/replayd.conf, $TMPFILESDIR/replayd.conf
#   $PREFIX/share/doc/replayd/                      README, operating, fleet, protocol
#
#   scripts/dev/install.sh                              # PREFIX=/usr/local, into /
#   make install PREFIX=/usr DESTDIR=/tmp/stage     # staged, e.g. for a package; no root needed
#
# Variables: PREFIX (/usr/local), DESTDIR (empty), SYSCONFDIR (/etc), BIN_SRC (where
# the built binaries are: target/release), UNITDIR, SYSUSERSDIR, TMPFILESDIR
# (default $PREFIX/lib/{systemd/system,sysusers.d,tmpfiles.d} for PREFIX /usr or
# /usr/local, which systemd searches, else under /etc).
set -euo pipefail
cd "$(dirname "$0")/../.."

PREFIX=${PREFIX:-/usr/local}
PREFIX=${PREFIX%/}
DESTDIR=${DESTDIR:-}
DESTDIR=${DESTDIR%/}
SYSCONFDIR=${SYSCONFDIR:-/etc}
BIN_SRC=${BIN_SRC:-target/release}
case "$PREFIX" in
  /usr | /usr/local) LIBDIR_SYSTEMD=$PREFIX/lib ;;
  *) LIBDIR_SYSTEMD= ;;  # systemd does not look under other prefixes
esac
UNITDIR=${UNITDIR:-${LIBDIR_SYSTEMD:+$LIBDIR_SYSTEMD/systemd/system}}
UNITDIR=${UNITDIR:-$SYSCONFDIR/systemd/system}
SYSUSERSDIR=${SYSUSERSDIR:-${LIBDIR_SYSTEMD:+$LIBDIR_SYSTEMD/sysusers.d}}
SYSUSERSDIR=${SYSUSERSDIR:-$SYSCONFDIR/sysusers.d}
TMPFILESDIR=${TMPFILESDIR:-${LIBDIR_SYSTEMD:+$LIBDIR_SYSTEMD/tmpfiles.d}}
TMPFILESDIR=${TMPFILESDIR:-$SYSCONFDIR/tmpfiles.d}
BINDIR=$PREFIX/bin
DOCDIR=$PREFIX/share/doc/replayd
CONFIG=$SYSCONFDIR/replayd/replayd.toml

die() { echo "install.sh: $*" >&2; exit 1; }
for b in replayd replayctl; do
  [ -x "$BIN_SRC/$b" ] || die "$BIN_SRC/$b is missing: build first (make build), or set BIN_SRC"
done

# The service's config: the documented default with the paths the unit provides.
# Each substitution must hit exactly one line, so a change of the default's layout
# fails here instead of installing a config that points at the wrong place.
service_config() {
  local src=config/replayd.toml
  local key pattern
  for key in runtime_dir control_endpoint kernel_cache_dir model_path; do
    case $key in
      runtime_dir) pattern='^#? *runtime_dir *=' ;;
      control_endpoint) pattern='^#? *control_endpoint *=' ;;
      kernel_cache_dir) pattern='^#? *kernel_cache_dir *=' ;;
      model_path) pattern='^path *= *"models/' ;;
    esac
    [ "$(grep -cE "$pattern" "$src")" = 1 ] || die "$src: expected one line matching /$pattern/"
  done
  echo "# replayd service configuration, installed by scripts/dev/install.sh from the"
  echo "# documented default (config/replayd.toml; $DOCDIR/operating.md explains the"
  echo "# keys). Paths are those of the systemd unit: sockets in /run/replayd"
  echo "# (RuntimeDirectory=), kernels in /var/cache/replayd/kernels (CacheDirectory=),"
  echo "# models in /var/lib/replayd/models (replayd.tmpfiles.conf)."
  echo "# After an edit: \`systemctl reload replayd\` (operating.md says which keys a"
  echo "# reload applies and which need \`systemctl restart replayd\`)."
  echo
  sed -E \
    -e 's|^#? *runtime_dir *=.*|runtime_dir = "/run/replayd"|' \
    -e 's|^#? *control_endpoint *=.*|control_endpoint = "ipc:///run/replayd/control.sock"|' \
    -e 's|^#? *kernel_cache_dir *=.*|kernel_cache_dir = "/var/cache/replayd/kernels"|' \
    -e 's|^path *= *"models/|path = "/var/lib/replayd/models/|' \
    "$src"
}

# The unit with this prefix's binary and documentation paths.
unit_for_prefix() {
  sed -e "s|/usr/bin/replayd|$BINDIR/replayd|g" \
      -e "s|/usr/bin/replayctl|$BINDIR/replayctl|g" \
      -e "s|file:///usr/share/doc/replayd/|file://$DOCDIR/|g" \
      systemd/replayd.service
}

install -d -m 0755 "$DESTDIR$BINDIR" "$DESTDIR$UNITDIR" "$DESTDIR$SYSUSERSDIR" \
  "$DESTDIR$TMPFILESDIR" "$DESTDIR$DOCDIR" "$DESTDIR$SYSCONFDIR/replayd"
install -m 0755 "$BIN_SRC/replayd" "$BIN_SRC/replayctl" "$DESTDIR$BINDIR/"
unit_for_prefix > "$DESTDIR$UNITDIR/replayd.service.tmp"
chmod 0644 "$DESTDIR$UNITDIR/replayd.service.tmp"
mv "$DESTDIR$UNITDIR/replayd.service.tmp" "$DESTDIR$UNITDIR/replayd.service"
install -m 0644 systemd/replayd.sysusers.conf "$DESTDIR$SYSUSERSDIR/replayd.conf"
install -m 0644 systemd/replayd.tmpfiles.conf "$DESTDIR$TMPFILESDIR/replayd.conf"
for d in README.md docs/operating.md docs/fleet.md docs/protocol.md; do
  [ -f "$d" ] && install -m 0644 "$d" "$DESTDIR$DOCDIR/"
done

new_config=$(mktemp)
trap 'rm -f "$new_config"' EXIT
service_config > "$new_config"
config_note=
if [ -e "$DESTDIR$CONFIG" ]; then
  if cmp -s "$new_config" "$DESTDIR$CONFIG"; then
    config_note="unchanged"
  else
    # Never overwrite an operator's config; leave the new default beside it.
    install -m 0644 "$new_config" "$DESTDIR$CONFIG.new"
    config_note="kept; the new default is $CONFIG.new (diff them)"
  fi
else
  install -m 0644 "$new_config" "$DESTDIR$CONFIG"
  config_note="installed"
fi

cat <<EOF
replayd installed${DESTDIR:+ under DESTDIR=$DESTDIR}:
  $BINDIR/replayd, $BINDIR/replayctl
  $CONFIG ($config_note)
  $UNITDIR/replayd.service
  $SYSUSERSDIR/replayd.conf, $TMPFILESDIR/replayd.conf
  $DOCDIR/

Next, as root:
  systemd-sysusers                 # the replayd user and group
  systemd-tmpfiles --create        # /var/lib/replayd/models, /var/cache/replayd/kernels
  # put the model folder in /var/lib/replayd/models/all-MiniLM-L6-v2 (scripts/dev/fetch-model.sh
  # fetches it into models/), and review $CONFIG
  systemctl daemon-reload
  systemctl enable --now replayd   # returns once every graph is captured (Type=notify)
  systemctl status replayd; journalctl -u replayd -f
  replayctl --config $CONFIG health
EOF
