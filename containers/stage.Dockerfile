# posttrain-<stage>: one stage's image, for every stage id (components/core/stages.py):
# the base image plus an entrypoint that runs `posttrain stage <STAGE>` under the base's
# init (tini), so a pod passes only the stage arguments
# (--recipe R --run-root URI --iteration K [--shard i/n]).
#
#   podman build -f containers/stage.Dockerfile --build-arg STAGE=rollout -t posttrain-rollout:0.1.0 .
ARG BASE_IMAGE=posttrain-base
ARG POSTTRAIN_VERSION=0.1.0
FROM ${BASE_IMAGE}:${POSTTRAIN_VERSION}

ARG STAGE
ENV POSTTRAIN_STAGE=${STAGE}
LABEL org.opencontainers.image.title="posttrain-${STAGE}"
# Fails the build for an empty or unknown STAGE (argparse lists the stage ids).
RUN posttrain-stage --help >/dev/null
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "posttrain-stage"]
CMD ["--help"]
