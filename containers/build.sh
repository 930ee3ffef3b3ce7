#!/usr/bin/env bash
# Build the posttrain images: posttrain-base:<version> (containers/base.Dockerfile), then
# posttrain-<stage>:<version> for every stage (containers/stage.Dockerfile, STAGE=<stage>).
#
#   containers/build.sh                       # docker (podman when there is no docker)
#   ENGINE=podman containers/build.sh         # podman build --runtime runc (PODMAN_RUNTIME=...)
#   BASE_IMAGE=localhost/posttrain-debian:bookworm containers/build.sh   # containers/debian-base.sh's base
#   TORCH=cuda containers/build.sh            # PyPI's CUDA torch (GPU clusters); default cpu
#   PREFIX=registry.example.com/ml/ PUSH=1 containers/build.sh
#   containers/build.sh --hash                # print the build inputs' hash and exit
#
# Environment:
#   BASE_IMAGE       default python:3.11.13-slim-bookworm
#   TORCH            cpu (default) | cuda; anything else fails the build
#   TORCH_CPU_INDEX  where the CPU wheel comes from without a local one
#                    (default https://download.pytorch.org/whl/cpu)
#   WHEELS           a folder of wheels the build may install from (the CPU torch wheel);
#                    default: pip's find-links when it is a local folder ($PIP_FIND_LINKS or
#                    `pip config get global.find-links`), else none
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL   the package index; passed as build secrets
#   PIP_CERT         CA bundle for TLS to the index (default: `pip config get global.cert`);
#                    a build secret
#   PIP_CONF         a pip.conf to give the build whole (a build secret); the host's own is
#                    not passed by default, it names host-only paths
#   REUSE=1          skip an image whose posttrain.inputs label already equals the hash
#   BUILD_FLAGS      more flags for every `build` (e.g. "--network host")
#
# The build context is a staged copy of only what the image needs (pyproject.toml,
# README.md, components/, dags/, pipelines/, recipes/ and the few containers/ files the
# Dockerfiles read), never the repo root with its .venv and .posttrain. Every image gets
# the label posttrain.inputs=<hash of that context and the build settings>, so a caller
# can tell an up-to-date image from a stale one (tests/fixtures/images.py).
set -euo pipefail

cd "$(dirname "$0")/.."
if [ -z "${ENGINE:-}" ]; then
  if command -v docker >/dev/null; then ENGINE=docker; else ENGINE=podman; fi
fi
PREFIX="${PREFIX:-}"
PUSH="${PUSH:-0}"
REUSE="${REUSE:-0}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11.13-slim-bookworm}"
TORCH="${TORCH:-cpu}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
VERSION="${VERSION:-$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')}"
STAGES=(bootstrap taskgen rollout sandbox reward validation trainer evaluation)

case "$TORCH" in
  cpu | cuda) ;;
  *) echo "build.sh: error: TORCH=$TORCH; use TORCH=cpu (CPU-only torch) or TORCH=cuda (PyPI's CUDA build)" >&2; exit 2 ;;
esac

pip_config() {  # pip_config <key>: a value from the host's pip configuration, '' when unset
  local pip
  for pip in pip3 pip .venv/bin/pip; do
    if command -v "$pip" >/dev/null; then
      "$pip" config get "$1" 2>/dev/null && return 0
    fi
  done
  return 0
}

if [ -z "${WHEELS+set}" ]; then
  WHEELS=""
  for link in ${PIP_FIND_LINKS:-$(pip_config global.find-links)}; do
    link="${link#file://}"
    if [ -d "$link" ]; then WHEELS="$link"; break; fi
  done
fi
PIP_CERT="${PIP_CERT-$(pip_config global.cert)}"

CONTEXT_PATHS=(pyproject.toml README.md components dags pipelines recipes)
CONTAINER_FILES=(base.Dockerfile stage.Dockerfile pip-env.sh constraints.txt stage-entrypoint.sh)
for path in "${CONTEXT_PATHS[@]}" "${CONTAINER_FILES[@]/#/containers/}"; do
  if [ ! -e "$path" ]; then
    echo "build.sh: error: $PWD/$path is missing; the image build needs it (README.md: pyproject's readme)" >&2
    exit 2
  fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
context="$work/context"
secrets="$work/secrets"
mkdir -p "$context" "$secrets" "$work/no-wheels"
chmod 700 "$secrets"
tar --exclude=__pycache__ --exclude='*.pyc' -cf - "${CONTEXT_PATHS[@]}" "${CONTAINER_FILES[@]/#/containers/}" \
  | tar -xf - -C "$context"

# What the images are made from: the context's files (path, mode, content), the settings,
# the base image's id when the engine has it locally, and the wheel folder's listing.
inputs_hash() {
  local base_id
  base_id="$("$ENGINE" image inspect --format '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || true)"
  {
    (cd "$context" && find . -type f -printf '%p %m\n' | LC_ALL=C sort)
    (cd "$context" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
    echo "base=$BASE_IMAGE@$base_id torch=$TORCH index=$TORCH_CPU_INDEX version=$VERSION prefix=$PREFIX"
    if [ -n "$WHEELS" ]; then (cd "$WHEELS" && find . -maxdepth 1 -name '*.whl' -printf '%f %s\n' | LC_ALL=C sort); fi
  } | sha256sum | cut -c1-16
}
HASH="$(inputs_hash)"
if [ "${1:-}" = --hash ]; then
  echo "$HASH"
  exit 0
fi

build_args=()
if [ "$ENGINE" = podman ] || [ "$(basename "$ENGINE")" = podman ]; then
  # podman's OCI runtime for the RUN steps; runc is what these hosts ship (crun may be absent)
  build_args+=(--runtime "${PODMAN_RUNTIME:-runc}")
fi
read -r -a extra <<<"${BUILD_FLAGS:-}"
build_args+=("${extra[@]}" --label "posttrain.inputs=$HASH")

# Build secrets: files that exist only while a RUN step mounts them (containers/pip-env.sh).
secret_args=()
secret_value() {  # secret_value <id> <value>
  printf '%s\n' "$2" >"$secrets/$1"
  secret_args+=(--secret "id=$1,src=$secrets/$1")
}
[ -z "${PIP_INDEX_URL:-}" ] || secret_value pip_index_url "$PIP_INDEX_URL"
[ -z "${PIP_EXTRA_INDEX_URL:-}" ] || secret_value pip_extra_index_url "$PIP_EXTRA_INDEX_URL"
if [ -n "$PIP_CERT" ]; then secret_args+=(--secret "id=pip_cert,src=$PIP_CERT"); fi
if [ -n "${PIP_CONF:-}" ]; then secret_args+=(--secret "id=pip.conf,src=$PIP_CONF"); fi

up_to_date() {  # up_to_date <tag>: REUSE=1 and the image carries this build's hash
  [ "$REUSE" = 1 ] && [ "$("$ENGINE" image inspect --format '{{index .Labels "posttrain.inputs"}}' "$1" 2>/dev/null)" = "$HASH" ]
}

build() {  # build <name> <dockerfile> [extra args...]
  local name="$1" dockerfile="$2" tag="${PREFIX}posttrain-$1:${VERSION}"
  shift 2
  if up_to_date "$tag"; then
    echo "== $tag is up to date (posttrain.inputs=$HASH)"
  else
    echo "== $tag"
    "$ENGINE" build "${build_args[@]}" -f "$context/containers/$dockerfile" -t "$tag" "$@" "$context"
  fi
  if [ "$PUSH" = 1 ]; then
    "$ENGINE" push "$tag"
  fi
}

build base base.Dockerfile --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "POSTTRAIN_VERSION=$VERSION" \
  --build-arg "TORCH=$TORCH" --build-arg "TORCH_CPU_INDEX=$TORCH_CPU_INDEX" \
  --build-context "wheels=${WHEELS:-$work/no-wheels}" "${secret_args[@]}"
for stage in "${STAGES[@]}"; do
  build "$stage" stage.Dockerfile --build-arg "STAGE=$stage" \
    --build-arg "BASE_IMAGE=${PREFIX}posttrain-base" --build-arg "POSTTRAIN_VERSION=$VERSION"
done
