#!/usr/bin/env bash
# Build the posttrain images: the base first, then one image per stage FROM it.
#
#   containers/build.sh                          # docker, tags posttrain-<name>:<version>
#   ENGINE=podman containers/build.sh            # podman, with --runtime runc (PODMAN_RUNTIME=...)
#   PREFIX=registry.example.com/ml/ PUSH=1 containers/build.sh
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu containers/build.sh   # CPU-only torch
#
# The build context is a staged copy of only what the image needs (pyproject.toml,
# README.md, components/, dags/, pipelines/, recipes/), never the repo root with its
# .venv and .posttrain.
set -euo pipefail

cd "$(dirname "$0")/.."
ENGINE="${ENGINE:-docker}"
PREFIX="${PREFIX:-}"
PUSH="${PUSH:-0}"
VERSION="${VERSION:-$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')}"
STAGES=(bootstrap taskgen rollout sandbox reward validation trainer evaluation)

build_args=()
if [ "$ENGINE" = podman ]; then
  # podman's OCI runtime for the RUN steps; runc is what these hosts ship (crun may be absent)
  build_args+=(--runtime "${PODMAN_RUNTIME:-runc}")
fi

CONTEXT_PATHS=(pyproject.toml README.md components dags pipelines recipes containers)
for path in "${CONTEXT_PATHS[@]}"; do
  if [ ! -e "$path" ]; then
    echo "build.sh: error: $PWD/$path is missing; the image build needs it (README.md: pyproject's readme)" >&2
    exit 2
  fi
done

context="$(mktemp -d)"
trap 'rm -rf "$context"' EXIT
tar --exclude=__pycache__ --exclude='*.pyc' -cf - "${CONTEXT_PATHS[@]}" \
  | tar -xf - -C "$context"

build() {  # build <name> <dockerfile> [extra args...]
  local name="$1" dockerfile="$2"
  shift 2
  echo "== ${PREFIX}posttrain-${name}:${VERSION}"
  "$ENGINE" build "${build_args[@]}" -f "$context/$dockerfile" -t "${PREFIX}posttrain-${name}:${VERSION}" "$@" "$context"
  if [ "$PUSH" = 1 ]; then
    "$ENGINE" push "${PREFIX}posttrain-${name}:${VERSION}"
  fi
}

build base containers/base/Dockerfile \
  --build-arg "POSTTRAIN_VERSION=${VERSION}" --build-arg "PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-}"
for stage in "${STAGES[@]}"; do
  build "$stage" "containers/$stage/Dockerfile" \
    --build-arg "BASE_IMAGE=${PREFIX}posttrain-base" --build-arg "POSTTRAIN_VERSION=${VERSION}"
done
