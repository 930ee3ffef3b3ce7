# posttrain-base: the runtime every stage image shares (containers/stage.Dockerfile adds
# the entrypoint). Build it with containers/build.sh, which stages a minimal context and
# wires the package index, its CA and a local wheel folder in; see containers/README.md.
#
#   BASE_IMAGE  python:3.11.13-slim-bookworm (the official image), or the same made from
#               Debian packages where no registry is reachable (containers/debian-base.sh)
#   TORCH       cpu: torch's CPU build, from a wheel in the `wheels` build context when one
#               is there, else from TORCH_CPU_INDEX; cuda: PyPI's torch (CUDA build)
#
# Secrets (never in a layer): pip.conf, pip_index_url, pip_extra_index_url, pip_cert
# (containers/pip-env.sh). Build contexts: `wheels`, a folder of wheels (may be empty).
ARG BASE_IMAGE=python:3.11.13-slim-bookworm
FROM ${BASE_IMAGE}

ARG POSTTRAIN_VERSION=0.1.0
ARG TORCH=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# The interpreter of the project's venv: one that both bases have (/usr/local/bin/python3.11
# in the official image, Debian's /usr/bin/python3.11 in the Debian-made one).
ARG VENV_PYTHON=python3.11

LABEL org.opencontainers.image.title="posttrain-base" \
      org.opencontainers.image.version="${POSTTRAIN_VERSION}" \
      org.opencontainers.image.description="RL post-training of language models: shared stage runtime"

# bubblewrap isolates sandbox jobs; Debian's python3 (/usr/bin/python3, the only host tree
# a sandbox sees is /usr) runs them; python3-venv makes the project's venv on the Debian
# base; libseccomp2 backs pyseccomp; tini is the entrypoint's init (below). Versions are not pinned: bookworm's point releases
# (+deb12uN) replace the old package in the archive, so a pin would break the build as soon
# as a security fix ships.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap python3 python3-venv libseccomp2 tini ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --gid 10001 posttrain \
    && useradd --uid 10001 --gid posttrain --create-home --shell /usr/sbin/nologin posttrain \
    && "$VENV_PYTHON" -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# torch first (its own layer: the largest, and the one TORCH chooses), version from the lock.
# The pip cache is a build cache mount, so rebuilds reuse downloads and no layer keeps them.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip_index_url \
    --mount=type=secret,id=pip_extra_index_url --mount=type=secret,id=pip_cert \
    --mount=type=bind,source=containers,target=/tmp/containers \
    --mount=type=bind,from=wheels,target=/tmp/wheels \
    --mount=type=cache,target=/root/.cache/pip \
    . /tmp/containers/pip-env.sh \
    && grep '^torch==' /tmp/containers/constraints.txt >/tmp/torch.txt \
    && case "$TORCH" in \
         cpu) if ls /tmp/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then \
                pip install --no-deps --no-index --find-links /tmp/wheels -r /tmp/torch.txt; \
              else \
                pip install --no-deps --index-url "$TORCH_CPU_INDEX" -r /tmp/torch.txt; \
              fi ;; \
         cuda) pip install -r /tmp/torch.txt ;; \
         *) echo "TORCH=$TORCH: build with --build-arg TORCH=cpu (CPU-only torch) or TORCH=cuda (PyPI's CUDA build)" >&2; \
            exit 1 ;; \
       esac \
    && rm /tmp/torch.txt

# Everything pyproject.toml depends on, at the lock's versions (containers/constraints.txt,
# the versions the tests ran), before the sources: editing code does not redo this layer.
# psycopg2 lets the same image serve as the MLflow tracking server on Postgres.
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=pip_index_url \
    --mount=type=secret,id=pip_extra_index_url --mount=type=secret,id=pip_cert \
    --mount=type=bind,source=containers,target=/tmp/containers \
    --mount=type=bind,source=pyproject.toml,target=/tmp/pyproject.toml \
    --mount=type=cache,target=/root/.cache/pip \
    . /tmp/containers/pip-env.sh \
    && python -c 'import tomllib; print(*tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
       >/tmp/requirements.txt \
    && pip install -c /tmp/containers/constraints.txt -r /tmp/requirements.txt psycopg2-binary==2.9.13 \
    && python -c 'import importlib.metadata as m, os, sys; t, v = os.environ["TORCH"], m.version("torch"); sys.exit(0 if (t == "cpu") == v.endswith("+cpu") else f"torch {v} is not the {t} build")' \
    && rm /tmp/requirements.txt

WORKDIR /opt/posttrain
COPY pyproject.toml README.md ./
COPY components ./components
COPY dags ./dags
COPY pipelines ./pipelines
COPY recipes ./recipes
COPY --chmod=755 containers/stage-entrypoint.sh /usr/local/bin/posttrain-stage
# This checkout; its dependencies are all in place (the layer above), so no index is needed.
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && pip check \
    && rm -rf build ./*.egg-info

USER 10001:10001
# POSTTRAIN_RECIPE: the default recipe is recipes/demo.yaml beside the installed package,
# which the non-editable install above puts in site-packages without recipes/; name the
# copy in the working directory instead (a --recipe, or an orchestrator's setting, wins).
ENV POSTTRAIN_HOME=/home/posttrain/.posttrain \
    POSTTRAIN_RECIPE=/opt/posttrain/recipes/demo.yaml \
    POSTTRAIN_CODE_VERSION=${POSTTRAIN_VERSION} \
    POSTTRAIN_IMAGE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Fails the build when the image lacks what the sandbox needs (bwrap, setpriv, dash,
# /usr/bin/python3 runnable by the sandbox uid, seccomp); namespaces are checked at run
# time (`posttrain sandbox doctor`), a build has none to give.
RUN posttrain sandbox doctor --installed
# tini runs posttrain as its child and reaps what it is handed: a PID 1 that does not reap
# keeps every process bwrap leaves behind as a zombie, and zombies count against the
# sandbox jobs' process limit until new sandboxes fail (components/sandbox/doctor.py).
# -s: the same when an outer init (podman/docker --init) is PID 1.
ENTRYPOINT ["/usr/bin/tini", "-s", "--", "posttrain"]
CMD ["--help"]
