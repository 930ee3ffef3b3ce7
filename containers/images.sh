#!/usr/bin/env bash
# `make images`: every posttrain image on a host with podman and no image registry (this
# project's CI machines, an air-gapped cluster's build host), in one command:
#   1. the base from Debian packages (containers/debian-base.sh; skipped when it exists),
#   2. posttrain-base and the eight stage images from it (containers/build.sh) with podman,
#      CPU torch from pip's local wheel folder (or the CPU index), the index and its CA
#      from pip's configuration as build secrets; images whose inputs did not change are
#      kept (REUSE=1).
# Any of build.sh's variables (TORCH, WHEELS, PIP_INDEX_URL, PREFIX, PUSH, ...) still apply.
set -euo pipefail
cd "$(dirname "$0")/.."
export ENGINE="${ENGINE:-podman}"
export DEBIAN_BASE_IMAGE="${DEBIAN_BASE_IMAGE:-localhost/posttrain-debian:bookworm}"
containers/debian-base.sh
BASE_IMAGE="$DEBIAN_BASE_IMAGE" TORCH="${TORCH:-cpu}" REUSE="${REUSE:-1}" exec containers/build.sh "$@"
