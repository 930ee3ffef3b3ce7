#!/usr/bin/env bash
# Make the image base from Debian packages, for hosts that reach no image registry (an
# air-gapped cluster's build host, a CI machine with only a Debian mirror): a bookworm
# root file system from debootstrap (minbase + python3 3.11, python3-venv,
# ca-certificates), imported as an image. It stands in for the official
# python:3.11.13-slim-bookworm in containers/base.Dockerfile:
#
#   containers/debian-base.sh                      # -> localhost/posttrain-debian:bookworm
#   containers/build.sh  with  BASE_IMAGE=localhost/posttrain-debian:bookworm
#
# Environment:
#   DEBIAN_MIRROR     the Debian archive (default: the first one the host's apt sources
#                     list for bookworm, else http://deb.debian.org/debian)
#   SECURITY_MIRROR   the security archive (default: the host's bookworm-security source,
#                     else http://deb.debian.org/debian-security)
#   DEBIAN_BASE_IMAGE the tag to create (default localhost/posttrain-debian:bookworm)
#   ENGINE            podman (default) or docker, for `import`
#   FORCE=1           rebuild even when the image already exists (otherwise this is a no-op)
#   APT_ETC           where the host's apt sources are read from (default /etc/apt)
#
# `containers/debian-base.sh --print-mirrors` prints the two archives it would use and exits.
#
# Needs root (debootstrap creates device nodes and chowns files) and the debootstrap and
# debian-archive-keyring packages.
set -euo pipefail

SUITE=bookworm
IMAGE="${DEBIAN_BASE_IMAGE:-localhost/posttrain-debian:bookworm}"
ENGINE="${ENGINE:-podman}"
PACKAGES="python3,python3-venv,ca-certificates"
APT_ETC="${APT_ETC:-/etc/apt}"

if [ "${1:-}" != --print-mirrors ] && [ "${FORCE:-0}" != 1 ] && "$ENGINE" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "debian-base.sh: $IMAGE exists (FORCE=1 rebuilds it)"
  exit 0
fi

# The archive URI the host's apt sources (one-line .list and deb822 .sources) give for a suite.
host_mirror() {  # host_mirror <suite>
  python3 - "$1" "$APT_ETC" <<'EOF'
import glob, re, sys

suite, etc = sys.argv[1], sys.argv[2]
for path in [f"{etc}/sources.list", *sorted(glob.glob(f"{etc}/sources.list.d/*.list"))]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        continue
    for line in lines:
        words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()  # drop [ options ]
        if len(words) >= 3 and words[0] == "deb" and words[2] == suite:
            print(words[1].rstrip("/"))
            sys.exit(0)
for path in sorted(glob.glob(f"{etc}/sources.list.d/*.sources")):
    try:
        stanzas = open(path).read().split("\n\n")
    except OSError:
        continue
    for stanza in stanzas:
        fields = {}
        for line in stanza.splitlines():
            if ":" in line and not line.startswith(("#", " ")):
                key, value = line.split(":", 1)
                fields[key.strip().lower()] = value.split()
        if "deb" in fields.get("types", []) and suite in fields.get("suites", []) and fields.get("uris"):
            print(fields["uris"][0].rstrip("/"))
            sys.exit(0)
EOF
}

MIRROR="${DEBIAN_MIRROR:-$(host_mirror "$SUITE")}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
SECURITY="${SECURITY_MIRROR:-$(host_mirror "$SUITE-security")}"
SECURITY="${SECURITY:-http://deb.debian.org/debian-security}"
if [ "${1:-}" = --print-mirrors ]; then
  echo "$MIRROR $SECURITY"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  echo "debian-base.sh: error: debootstrap needs root; run it as root (or pull python:3.11.13-slim-bookworm instead)" >&2
  exit 2
fi
command -v debootstrap >/dev/null || { echo "debian-base.sh: error: apt-get install debootstrap" >&2; exit 2; }

root="$(mktemp -d /var/tmp/posttrain-debian.XXXXXX)"
trap 'rm -rf "$root"' EXIT
echo "== debootstrap $SUITE from $MIRROR into $root"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR"

cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
EOF
# Like the official slim images: no package lists or downloaded .debs in the image.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/var/log/*.log "$root"/var/log/apt/* "$root"/tmp/* "$root"/root/.cache
: >"$root/etc/hostname"
: >"$root/etc/resolv.conf"

echo "== import $IMAGE"
tar --numeric-owner --xattrs -C "$root" -cf - . | "$ENGINE" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change "LABEL org.opencontainers.image.title=posttrain-debian" \
  --change "LABEL org.opencontainers.image.source=debootstrap:$SUITE:$MIRROR" \
  --change 'CMD ["python3"]' \
  - "$IMAGE"
run_flags=()
if [ "$ENGINE" = podman ]; then
  read -r -a run_flags <"$(dirname "$0")/podman-run-flags"
fi
"$ENGINE" run --rm "${run_flags[@]}" "$IMAGE" python3 -c 'import sys, ssl, venv; print("python", sys.version.split()[0])'
echo "== $IMAGE ready"
