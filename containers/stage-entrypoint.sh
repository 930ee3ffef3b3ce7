#!/bin/sh
# Entrypoint of the stage images (containers/stage.Dockerfile): `posttrain stage <stage>`,
# the stage named at build time (ENV POSTTRAIN_STAGE), followed by what the pod passes
# (--recipe R --run-root URI --iteration K [--shard i/n]).
set -eu
: "${POSTTRAIN_STAGE:?posttrain-stage: POSTTRAIN_STAGE is not set (build the image with --build-arg STAGE=<stage>)}"
exec posttrain stage "$POSTTRAIN_STAGE" "$@"
